"""Context parallel, ulysses mode (``parallel_config.context_parallel_mode: ulysses``): an all-to-all of heads
and sequence around the ordinary attention kernel.

Each rank of a context group of N holds its share of every row (the load-balanced front and back chunks of
parallel/ring_attention.py, for all heads). Before attention one all-to-all trades sequence for heads: rank r
sends head group d (query heads [d h/N, (d+1) h/N) and KV heads [d hk/N, (d+1) hk/N)) of its tokens to rank d
and receives head group r of every rank's tokens. The received shares, laid end to end in rank order, are put
back in the row's natural order, so the rank holds whole rows of h/N query heads and hk/N KV heads (the query
heads of a KV head stay together: grouped-query attention needs nothing more) and runs the attention the
model runs in one process (the fused CPU kernel or flash attention, causal, or the whole rows' segment ids of
packed rows). The output goes back to the balanced layout and the reverse all-to-all returns every rank its
tokens for all heads. Both all-to-alls are differentiable (their backward is the reverse exchange), so the
backward is exact too.

The exchange is the one expert parallel uses (parallel/expert_parallel.py ``ExpertGroup.all_to_all``): NCCL's
``alltoall_single`` on a GPU; on the CPU build, where gloo has none, ``cpu_compat.all_to_all_rows`` (pairwise
send/recv in a group per pair of ranks, the same rows).

Against the ring: two all-to-alls of q, k, v and the output per layer (each rank sends (N-1)/N of them)
instead of N-1 hops of K/V; one attention call per layer over whole rows; but the KV heads (per tensor rank)
must be divisible by N, which config/context_checks.py checks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import numpy as np
import paddle

from bmtrain_cli.models.attention import build_bias
from bmtrain_cli.models.attention_choice import ScoreRule
from bmtrain_cli.parallel.expert_parallel import ExpertGroup, all_to_all
from bmtrain_cli.parallel.ring_attention import local_indices

# the model's attention over whole rows: (q, k, v, the rows' segment ids, an additive bias or None, and the
# keywords ``window`` and ``softcap`` of models/attention.py attend) -> output
WholeAttention = Callable[..., paddle.Tensor]


def layout_order(seq_len: int, degree: int) -> np.ndarray:
    """The token index at each place of the ranks' shares laid end to end (rank 0's, then rank 1's...)."""
    return np.concatenate([local_indices(seq_len, degree, r) for r in range(degree)])


class UlyssesCore:
    """The attention core of one context group in ulysses mode (models/attention.py ``ContextShard.core``):
    q [b, 2c, h, d], k/v [b, 2c, hk, d] of this rank's chunks, the whole rows' int segment ids [b, S] (or
    None), ``whole``, the model's attention over whole rows of its heads, and the layer's
    :class:`ScoreRule`, whose sliding window (shorter than the rows) becomes the additive bias one process
    gives that attention (models/attention.py build_bias); with soft-capped scores (Gemma 2) the window and
    the cap go to that attention instead, whose blocked kernel applies both without an s x s bias."""

    def __init__(self, ring: Any) -> None:
        self.ring = ring  # the group's sums of partial log-probs (preference/logps.py) run over it
        self.group = ExpertGroup(ring.group, ring.ranks, ring.rank, pairs=ring.pairs)

    def __call__(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        segment_ids: Optional[paddle.Tensor],
        whole: WholeAttention,
        rule: ScoreRule = ScoreRule(),
    ) -> paddle.Tensor:
        n = self.group.degree
        b, s2, h, d = q.shape
        hk = k.shape[2]
        mask = segment_ids
        if rule.softcap is not None:
            whole = functools.partial(whole, window=rule.window, softcap=rule.softcap)
        elif rule.within(s2 * n).window is not None:
            mask = build_bias(segment_ids, segment_ids, s2 * n, s2 * n, 0, q.dtype, rule.window)
        if n == 1:
            return whole(q, k, v, mask)
        order = layout_order(s2 * n, n)
        natural = np.empty_like(order)
        natural[order] = np.arange(order.size)
        # [n, b, 2c, (h + 2 hk) / n, d]: head group d of q, k and v side by side, for rank d
        parts = [t.reshape([b, s2, n, t.shape[2] // n, d]).transpose([2, 0, 1, 3, 4]) for t in (q, k, v)]
        mine = self._exchange(paddle.concat(parts, axis=3))  # [n (source), b, 2c, heads, d]
        rows = mine.transpose([1, 0, 2, 3, 4]).reshape([b, s2 * n, mine.shape[3], d])
        rows = paddle.gather(rows, paddle.to_tensor(natural), axis=1)
        qw, kw, vw = paddle.split(rows, [h // n, hk // n, hk // n], axis=2)
        out = whole(qw, kw, vw, mask)  # [b, S, h / n, d]
        out = paddle.gather(out, paddle.to_tensor(order), axis=1).reshape([b, n, s2, h // n, d])
        back = self._exchange(out.transpose([1, 0, 2, 3, 4]))  # [n (head group), b, 2c, h / n, d]
        return back.transpose([1, 2, 0, 3, 4]).reshape([b, s2, h, d])

    def _exchange(self, x: paddle.Tensor) -> paddle.Tensor:
        """Slice d of ``x`` [n, ...] to rank d; the result's slice s came from rank s."""
        shape = x.shape
        one = [1] * self.group.degree
        return all_to_all(x.reshape([shape[0], -1]), self.group, one, one).reshape(shape)
