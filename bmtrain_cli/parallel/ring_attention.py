"""Context parallel: exact causal ring attention over a sequence split between the ranks of a context group.

Layout (load-balanced causal): a sequence of S tokens is cut into 2N chunks of c = S / 2N tokens; rank r of a
context group of N holds chunks r (its front) and 2N-1-r (its back), laid end to end. Every rank then has the
same causal work: :func:`local_indices` gives the token indices a rank holds.

Forward: the K/V of the group travel round the ring (rank r sends to r+1 and receives from r-1, N-1 times)
while each rank attends its queries to the K/V it holds; the partial results of the key chunks merge by their
log-sum-exp. A chunk pair is one call of the fused CPU attention kernel on a CPU (with our kernels) or of
Paddle's flash attention on a GPU (parallel/ring_pairs.py), else blocks of Paddle ops (parallel/ring_blocks.py,
the reference). Chunk pairs are decided by the chunks' places in the sequence: a key chunk before the query chunk
is fully visible, the same chunk is causal, a later chunk is skipped (so the K/V of a lower rank meet all the
local queries, those of a higher rank only the back chunk). Soft-capped scores (Gemma 2) are capped pair by pair (the fused
CPU kernel or the blocks; flash attention takes no cap). A layer's sliding window (keys ``window`` or more
positions before a query are not visible, on the tokens' places in the whole row) skips the pairs whose
keys all lie outside it (their K/V still travel on) and masks those it cuts. Packed rows restrict every pair further to equal
segment ids, read from the whole row's ids (every rank of the group holds the whole batch). K/V keep their
own number of heads (grouped-query attention): the query heads of a KV head are stacked on the query axis.

Backward: the K/V travel round again, each with its own gradient accumulator (dK, dV in fp32) that every rank
adds its share to; after N steps each accumulator comes home. Each rank keeps only its output and the
per-query log-sum-exp from the forward (the FlashAttention recurrences), so nothing of size S x S exists.
The pair kernels and the Paddle-op blocks (queries and keys in blocks of ``block`` tokens) both keep the
transient scores of a step from growing with the sequence or the chunk.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.attention_choice import RING_BLOCK, ScoreRule
from bmtrain_cli.models.scoring import right_padded
from bmtrain_cli.parallel.ring_blocks import blocks_backward, blocks_forward
from bmtrain_cli.parallel.ring_pairs import pair_backward, pair_forward, pair_kernel

Tensor = paddle.Tensor


def local_indices(seq_len: int, degree: int, rank: int) -> np.ndarray:
    """The token indices rank ``rank`` of a context group of ``degree`` holds: its front chunk then its
    back chunk (chunks ``rank`` and ``2 * degree - 1 - rank`` of ``seq_len / (2 * degree)`` tokens)."""
    c = seq_len // (2 * degree)
    back = 2 * degree - 1 - rank
    return np.concatenate([np.arange(rank * c, (rank + 1) * c), np.arange(back * c, (back + 1) * c)])


class Ring:
    """One context group as the ring attention sees it: this rank's index, the group's size, and the
    exchange with the ring's neighbours (send to the next rank, receive from the previous one). ``pairs``:
    a group per pair of members for the ulysses mode's all-to-all on the CPU build (cpu_compat.pair_groups),
    else None."""

    def __init__(
        self, group: Any, ranks: Sequence[int], rank: int, pairs: Optional[Dict[Tuple[int, int], Any]] = None
    ) -> None:
        self.group = group
        self.ranks = list(ranks)  # global ranks, in ring order
        self.rank = int(rank)  # index in the ring
        self.degree = len(self.ranks)
        self.pairs = pairs

    def exchange(self, tensors: List[paddle.Tensor]) -> List[paddle.Tensor]:
        """Send ``tensors`` to the next rank and receive the previous rank's (same shapes and dtypes)."""
        if self.degree == 1:
            return list(tensors)
        import paddle.distributed as dist

        nxt = self.ranks[(self.rank + 1) % self.degree]
        prev = self.ranks[(self.rank - 1) % self.degree]
        received = [paddle.empty_like(t) for t in tensors]
        # gloo's sends block until the peer receives: even ranks send first, odd ranks receive first, so
        # the ring never waits on itself (rank 0 sends while rank 1 receives, whatever the size)
        for t, r in zip(tensors, received):
            if self.rank % 2 == 0:
                dist.send(t, dst=nxt, group=self.group)
                dist.recv(r, src=prev, group=self.group)
            else:
                dist.recv(r, src=prev, group=self.group)
                dist.send(t, dst=nxt, group=self.group)
        return received

    def all_reduce(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum ``tensor`` over the group, in place (also returned)."""
        if self.degree > 1:
            import paddle.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The differentiable sum of ``tensor`` over the group (:class:`ContextSum`)."""
        return ContextSum.apply(tensor, self)

    def max(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """The largest value of ``tensor`` over the group (a copy; no gradient)."""
        out = tensor.detach().clone()
        if self.degree > 1:
            import paddle.distributed as dist

            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out


class ContextSum(PyLayer):
    """The sum of per-rank partial values over a context group, on every rank (``apply(x, ring)``). Its
    gradient is the sum of the group's gradients: when the ranks' losses are terms weighted to sum to one
    (preference pairs: the group's first rank counts them), each rank's partial gets the whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, ring: Ring) -> paddle.Tensor:
        ctx.ring = ring
        return ring.all_reduce(x.clone())

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        return ctx.ring.all_reduce(dy.clone())


def context_ring(hcg: Any, degree: int, pairs: bool = False) -> Ring:
    """This rank's :class:`Ring`: fleet's data-parallel groups cut into consecutive groups of ``degree``
    (every rank creates every group, in the same order, with a barrier after each: several gloo groups
    created back to back hang without one). ``pairs``: also a group per pair of members (the ulysses
    mode's all-to-all on gloo; a group of two is its own pair)."""
    import paddle.distributed as dist

    from bmtrain_cli.parallel.cpu_compat import pair_groups

    mine = None
    me = dist.get_rank()
    for data_ranks in hcg.topology().get_comm_list("data"):
        for i in range(0, len(data_ranks), degree):
            ranks = list(data_ranks[i : i + degree])
            group = dist.new_group(ranks)
            dist.barrier()
            held = None
            if pairs:
                held = {(0, 1): group} if degree == 2 else pair_groups(ranks)
            if me in ranks:
                mine = Ring(group, ranks, ranks.index(me), held)
    assert mine is not None  # every rank lies in one data-parallel group
    return mine


class RingAttention(PyLayer):
    @staticmethod
    def forward(
        ctx: Any,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        seg: Optional[paddle.Tensor],
        ring: Any,
        block: int,
        kernel: Any = None,
        rule: ScoreRule = ScoreRule(),
    ) -> paddle.Tensor:
        if kernel is None:
            out, lse = blocks_forward(q, k, v, seg, ring, block, rule)
        else:  # one kernel call per chunk pair
            out, lse = pair_forward(q, k, v, seg, ring, kernel, rule)
        # a copy of the segment ids: the caller's tensor may be released before the backward
        kept = None if seg is None else seg.clone()
        ctx.save_for_backward(q, k, v, out, lse, kept)
        ctx.ring, ctx.block, ctx.kernel, ctx.rule = ring, block, kernel, rule
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: the forward's output grads in, None grads out
        ctx: Any, dout: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        saved = ctx.saved_tensor()
        if ctx.kernel is None:
            dq, dk, dv = blocks_backward(saved, ctx.ring, ctx.block, dout, ctx.rule)
        else:
            dq, dk, dv = pair_backward(saved, ctx.ring, ctx.kernel, dout, ctx.rule)
        return (dq, dk, dv) if saved[5] is None else (dq, dk, dv, None)


class RingCore:
    """The attention core of one context group (models/attention.py ``ContextShard.core``): q [b, 2c, h, d],
    k/v [b, 2c, hk, d] of this rank's chunks, optional int segment ids [b, S] of the whole rows. The ring
    attends in chunk pairs itself: the model's attention over whole rows (``whole``, which the ulysses mode
    runs, parallel/ulysses.py) is not needed. ``fused``: the model's op set carries our fused CPU attention
    (kernels custom or auto with the kernels built), which then attends each chunk pair on a CPU; on a GPU
    Paddle's flash attention does where it applies (parallel/ring_pairs.py pair_kernel), else blocks of
    Paddle ops (parallel/ring_blocks.py). ``rule``: the layer's :class:`ScoreRule`, its sliding window
    (Gemma 3's sliding layers, Mistral; one as long as the rows holds every key) and its scores' soft cap
    (Gemma 2's attn_logit_softcapping, which the fused CPU kernel and the blocks apply)."""

    def __init__(self, ring: Any, block: int = RING_BLOCK, fused: bool = False) -> None:
        self.ring = ring
        self.block = int(block)
        self.fused = fused

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        segment_ids: Optional[Tensor],
        whole: Any = None,
        rule: ScoreRule = ScoreRule(),
    ) -> Tensor:
        seg = None if segment_ids is None else segment_ids.astype("int64")
        rule = rule.within(q.shape[1] * self.ring.degree)
        kernel = pair_kernel(q, seg, self.fused, self.ring.rank == 0, rule)
        return RingAttention.apply(q, k, v, seg, self.ring, self.block, kernel, rule)


def split_batch(batch: Dict[str, np.ndarray], degree: int, rank: int) -> Dict[str, np.ndarray]:
    """This rank's share of a collated batch (every rank of the context group holds the whole batch):
    ``input_ids``, ``targets`` (the next-token targets, shifted over the whole row before the split, -100
    across a segment boundary and at the row's end), ``position_ids`` (the tokens' positions in their
    row, for the rotary tables) and ``attention_mask`` (this share's segment ids, for counting), plus the
    whole rows' ``segment_ids`` for the ring when the rows are packed (right-padded rows attend causally,
    as in one process). Rows are padded to a multiple of 2 x ``degree`` first. A completion batch (GRPO,
    grpo/rollout.py ``pack``) has no labels: :func:`_completion_share`."""
    if "completion_ids" in batch:
        return _completion_share(batch, degree, rank)
    ids, labels = batch["input_ids"], batch["labels"]
    b, s = ids.shape
    mask = batch.get("attention_mask")
    mask = np.ones_like(ids) if mask is None else mask
    targets = np.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = np.where(mask[:, 1:] == mask[:, :-1], labels[:, 1:], IGNORE_INDEX)
    pos = batch.get("position_ids")
    pos = np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)) if pos is None else pos
    width = -(-s // (2 * degree)) * 2 * degree

    def pad(x: np.ndarray, value: int) -> np.ndarray:
        return np.pad(x, ((0, 0), (0, width - s)), constant_values=value)

    ids, targets, mask, pos = pad(ids, 0), pad(targets, IGNORE_INDEX), pad(mask, 0), pad(pos, 0)
    idx = local_indices(width, degree, rank)
    out = {
        "input_ids": ids[:, idx],
        "targets": targets[:, idx],
        "position_ids": np.ascontiguousarray(pos[:, idx]),
        "attention_mask": mask[:, idx],
    }
    if not right_padded(mask):
        out["segment_ids"] = mask.astype(np.int64)
    if "sequence_index" in batch:  # a pair batch (preference/batches.py)
        out.update(_pair_share(batch, width, idx, rank))
    return out


def _pair_share(batch: Dict[str, np.ndarray], width: int, idx: np.ndarray, rank: int) -> Dict[str, Any]:
    """The pair keys of a share: ``sequence_index`` at this share's targets (-1 where nothing is
    predicted), the batch's ``pair_ids`` and ``ref_logps`` whole, and ``context_lead`` (the group's first
    rank, which alone counts the pairs: every rank computes the pair losses from the summed log-probs)."""
    index = np.full((batch["sequence_index"].shape[0], width), -1, dtype=np.int64)
    index[:, : batch["sequence_index"].shape[1]] = batch["sequence_index"]
    out: Dict[str, Any] = {"sequence_index": index[:, idx], "context_lead": rank == 0}
    for key in ("pair_ids", "ref_logps"):
        if key in batch:
            out[key] = batch[key]
    return out


def _completion_share(batch: Dict[str, np.ndarray], degree: int, rank: int) -> Dict[str, Any]:
    """A completion batch's share: this rank's ``input_ids`` and ``position_ids`` of the right-padded rows
    (padded to a multiple of 2 x ``degree``; attended causally), ``context_columns`` (the row positions
    they are) and ``context_lead`` (the group's first rank, which alone counts the rows); every other key
    whole (prompt and completion layout, masks, advantages, old and reference log-probs), so that every
    rank of the group computes the loss of whole completions from their log-probs summed over the group
    (grpo/objective.py)."""
    ids = batch["input_ids"]
    s = ids.shape[1]
    width = -(-s // (2 * degree)) * 2 * degree
    idx = local_indices(width, degree, rank)
    ids, pos = (np.pad(x, ((0, 0), (0, width - s))) for x in (ids, batch["position_ids"]))
    return {
        **batch,
        "input_ids": ids[:, idx],
        "position_ids": np.ascontiguousarray(pos[:, idx]),
        "context_columns": idx,
        "context_lead": rank == 0,
    }
