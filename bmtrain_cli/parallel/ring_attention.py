"""Context parallel: exact causal ring attention over a sequence split between the ranks of a context group.

Layout (load-balanced causal): a sequence of S tokens is cut into 2N chunks of c = S / 2N tokens; rank r of a
context group of N holds chunks r (its front) and 2N-1-r (its back), laid end to end. Every rank then has the
same causal work: :func:`local_indices` gives the token indices a rank holds.

Forward: the K/V of the group travel round the ring (rank r sends to r+1 and receives from r-1, N-1 times)
while each rank attends its queries to the K/V it holds; the partial results of the key chunks merge by their
log-sum-exp. Chunk pairs are decided by the chunks' places in the sequence: a key chunk before the query chunk
is fully visible, the same chunk is causal, a later chunk is skipped (so the K/V of a lower rank meet all the
local queries, those of a higher rank only the back chunk). Packed rows restrict every pair further to equal
segment ids, read from the whole row's ids (every rank of the group holds the whole batch). K/V keep their
own number of heads (grouped-query attention): the query heads of a KV head are stacked on the query axis.

Backward: the K/V travel round again, each with its own gradient accumulator (dK, dV in fp32) that every rank
adds its share to; after N steps each accumulator comes home. Each rank keeps only its output and the
per-query log-sum-exp from the forward (the FlashAttention recurrences), so nothing of size S x S exists.
Queries and keys are both taken in blocks of ``block`` tokens, so the transient scores of one block pair
(and their probabilities and gradients) do not grow with the sequence or the chunk.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.attention_choice import RING_BLOCK
from bmtrain_cli.models.scoring import right_padded

Tensor = paddle.Tensor

# a masked score: finite, so that a query that sees no key of a chunk pair gets a finite log-sum-exp whose
# weight in the merge (and whose probabilities in the backward) underflow to exactly zero
_MASKED = -1e30


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


def _pairs(q_chunks: Tuple[int, int], k_chunks: Tuple[int, int]) -> List[Tuple[int, int, bool]]:
    """(query slot, key slot, causal) of the chunk pairs with something visible: a key chunk before the
    query chunk is fully visible, the same chunk causal, a later one not at all."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            if kc <= qc:
                out.append((qi, ki, kc == qc))
    return out


def _chunks(degree: int, rank: int) -> Tuple[int, int]:
    return rank, 2 * degree - 1 - rank


class _Layout:
    """Shapes and per-block masks of one call: q [b, 2c, h, d] and k/v [b, 2c, hk, d] on every rank. Queries
    are grouped by KV head, token-major: row t * rep + j of [b, hk, c * rep, d] is token t, query head j of
    the KV head; a block of ``block`` tokens of a query chunk is a contiguous row range."""

    def __init__(self, q: paddle.Tensor, k: paddle.Tensor, seg: Optional[paddle.Tensor], block: int) -> None:
        self.b, s2, self.h, self.d = q.shape
        self.hk = k.shape[2]
        self.rep = self.h // self.hk
        self.c = s2 // 2
        self.seg = seg
        self.scale = float(self.d) ** -0.5
        self.block = block
        self.blocks = [(t, min(t + block, self.c)) for t in range(0, self.c, block)]

    def q_slot(self, x: paddle.Tensor, i: int) -> paddle.Tensor:
        """Slot i (0 front, 1 back) of a [b, 2c, heads, d] tensor as [b, hk, c * rep, d]."""
        part = x[:, i * self.c : (i + 1) * self.c]
        g = part.reshape([self.b, self.c, self.hk, self.rep, x.shape[-1]]).transpose([0, 2, 1, 3, 4])
        return g.reshape([self.b, self.hk, self.c * self.rep, x.shape[-1]])

    def ungroup(self, x: paddle.Tensor) -> paddle.Tensor:
        """[b, hk, c * rep, d] -> [b, c, h, d]."""
        g = x.reshape([self.b, self.hk, self.c, self.rep, self.d]).transpose([0, 2, 1, 3, 4])
        return g.reshape([self.b, self.c, self.h, self.d])

    def rows(self, t0: int, t1: int) -> slice:
        return slice(t0 * self.rep, t1 * self.rep)

    def key_blocks(self, t1: int, causal: bool) -> List[Tuple[int, int]]:
        """The key blocks (chunk-local token ranges) a query block ending at token t1 can see: all of a full
        pair, those up to t1 of a causal one."""
        end = t1 if causal else self.c
        return [(k0, min(k0 + self.block, end)) for k0 in range(0, end, self.block)]

    def scores(
        self, qb: paddle.Tensor, kc: paddle.Tensor, qc: int, kchunk: int, t0: int, k0: int, causal: bool
    ) -> Any:
        """Masked fp32 scores [b, hk, n * rep, kl] of the query block starting at token t0 of chunk qc against
        the kl keys of chunk kchunk starting at token k0 (kc [b, hk, kl, d])."""
        s = paddle.matmul(qb, kc, transpose_y=True).astype("float32") * self.scale
        n, kl = qb.shape[2] // self.rep, kc.shape[2]
        allowed = None
        if causal and k0 + kl > t0 + 1:  # a block pair on the diagonal: some keys lie after some queries
            q_tok = paddle.arange(n * self.rep, dtype="int64") // self.rep + t0
            k_tok = paddle.arange(k0, k0 + kl, dtype="int64")
            allowed = (k_tok.unsqueeze(0) <= q_tok.unsqueeze(1)).unsqueeze(0)
        if self.seg is not None:
            sq = self.seg[:, qc * self.c + t0 : qc * self.c + t0 + n]
            if self.rep > 1:
                sq = paddle.repeat_interleave(sq, self.rep, axis=1)
            sk = self.seg[:, kchunk * self.c + k0 : kchunk * self.c + k0 + kl]
            same = sq.unsqueeze(-1) == sk.unsqueeze(1)  # [b, n * rep, kl]
            allowed = same if allowed is None else paddle.logical_and(allowed, same)
        if allowed is None:
            return s
        return paddle.where(allowed.unsqueeze(1), s, paddle.full([1], _MASKED, dtype="float32"))


def _kv_layout(k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
    """k, v [b, 2c, hk, d] -> [2, b, hk, 2c, d]: what travels round the ring."""
    return paddle.stack([k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])])


def _merge(acc: Optional[Tuple[Any, Any]], o: paddle.Tensor, lse: paddle.Tensor) -> Tuple[Any, Any]:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exp."""
    if acc is None:
        return o, lse
    prev_o, prev_lse = acc
    new = paddle.logaddexp(prev_lse, lse)
    merged = prev_o * paddle.exp(prev_lse - new).unsqueeze(-1) + o * paddle.exp(lse - new).unsqueeze(-1)
    return merged, new


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
    ) -> paddle.Tensor:
        lay = _Layout(q, k, seg, block)
        q_chunks = _chunks(ring.degree, ring.rank)
        qgs = [lay.q_slot(q, i) for i in range(2)]
        acc: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
        kv = _kv_layout(k, v)
        for t in range(ring.degree):
            k_chunks = _chunks(ring.degree, (ring.rank - t) % ring.degree)
            incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
            for qi, ki, causal in _pairs(q_chunks, k_chunks):
                for bi, (t0, t1) in enumerate(lay.blocks):
                    qb = qgs[qi][:, :, lay.rows(t0, t1)]
                    for k0, k1 in lay.key_blocks(t1, causal):
                        keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                        kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                        s = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
                        lse = paddle.logsumexp(s, axis=-1)
                        o = paddle.matmul(paddle.exp(s - lse.unsqueeze(-1)).astype(vc.dtype), vc)
                        acc[(qi, bi)] = _merge(acc.get((qi, bi)), o.astype("float32"), lse)
            if incoming is not None:
                kv = incoming[0]
        nb = len(lay.blocks)
        outs = [paddle.concat([acc[(qi, bi)][0] for bi in range(nb)], axis=2) for qi in range(2)]
        lses = [paddle.concat([acc[(qi, bi)][1] for bi in range(nb)], axis=2) for qi in range(2)]
        out = paddle.concat([lay.ungroup(o) for o in outs], axis=1).astype(q.dtype)
        # a copy of the segment ids: the caller's tensor may be released before the backward
        kept = None if seg is None else seg.clone()
        ctx.save_for_backward(q, k, v, out, paddle.stack(lses), kept)
        ctx.ring, ctx.block = ring, block
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: the forward's output grads in, None grads out
        ctx: Any, dout: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        q, k, v, out, lse, seg = ctx.saved_tensor()
        ring = ctx.ring
        lay = _Layout(q, k, seg, ctx.block)
        q_chunks = _chunks(ring.degree, ring.rank)
        qgs = [lay.q_slot(q, i) for i in range(2)]
        dos = [lay.q_slot(dout, i) for i in range(2)]
        # D_i = sum_j P_ij dP_ij = dO_i . O_i
        deltas = [
            (dos[i].astype("float32") * lay.q_slot(out, i).astype("float32")).sum(axis=-1, keepdim=True)
            for i in range(2)
        ]
        dqs = [paddle.zeros(qgs[0].shape, dtype="float32") for _ in range(2)]
        kv = _kv_layout(k, v)
        dk = paddle.zeros(kv.shape[1:], dtype="float32")
        dv = paddle.zeros(kv.shape[1:], dtype="float32")
        for t in range(ring.degree):
            k_chunks = _chunks(ring.degree, (ring.rank - t) % ring.degree)
            incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
            for qi, ki, causal in _pairs(q_chunks, k_chunks):
                for t0, t1 in lay.blocks:
                    rows = lay.rows(t0, t1)
                    qb, dob = qgs[qi][:, :, rows], dos[qi][:, :, rows]
                    for k0, k1 in lay.key_blocks(t1, causal):
                        keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                        kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                        s = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
                        p = paddle.exp(s - lse[qi][:, :, rows].unsqueeze(-1))
                        del s
                        dv[:, :, keys] += paddle.matmul(p.astype(vc.dtype), dob, transpose_x=True).astype(
                            "float32"
                        )
                        dp = paddle.matmul(dob, vc, transpose_y=True).astype("float32")
                        ds = (p * (dp - deltas[qi][:, :, rows]) * lay.scale).astype(q.dtype)
                        del p, dp
                        dqs[qi][:, :, rows] += paddle.matmul(ds, kc).astype("float32")
                        dk[:, :, keys] += paddle.matmul(ds, qb, transpose_x=True).astype("float32")
            # the accumulators go on with the K/V they belong to; after the last step, home to their owner
            dk, dv = ring.exchange([dk, dv])
            if incoming is not None:
                kv = incoming[0]
        dq = paddle.concat([lay.ungroup(x) for x in dqs], axis=1).astype(q.dtype)
        dk = dk.transpose([0, 2, 1, 3]).astype(k.dtype)
        dv = dv.transpose([0, 2, 1, 3]).astype(v.dtype)
        return (dq, dk, dv) if seg is None else (dq, dk, dv, None)


class RingCore:
    """The attention core of one context group (models/attention.py ``ContextShard.core``): q [b, 2c, h, d],
    k/v [b, 2c, hk, d] of this rank's chunks, optional int segment ids [b, S] of the whole rows. The ring
    attends in blocks itself: the model's attention over whole rows (``whole``, which the ulysses mode
    runs, parallel/ulysses.py) is not needed."""

    def __init__(self, ring: Any, block: int = RING_BLOCK) -> None:
        self.ring = ring
        self.block = int(block)

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, segment_ids: Optional[Tensor], whole: Any = None
    ) -> Tensor:
        seg = None if segment_ids is None else segment_ids.astype("int64")
        return RingAttention.apply(q, k, v, seg, self.ring, self.block)


def split_batch(batch: Dict[str, np.ndarray], degree: int, rank: int) -> Dict[str, np.ndarray]:
    """This rank's share of a collated batch (every rank of the context group holds the whole batch):
    ``input_ids``, ``targets`` (the next-token targets, shifted over the whole row before the split, -100
    across a segment boundary and at the row's end), ``position_ids`` (the tokens' positions in their
    row, for the rotary tables) and ``attention_mask`` (this share's segment ids, for counting), plus the
    whole rows' ``segment_ids`` for the ring when the rows are packed (right-padded rows attend causally,
    as in one process). Rows are padded to a multiple of 2 x ``degree`` first."""
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
