"""Ring attention with a sliding window (parallel/ring_attention.py, ring_pairs.py, ring_blocks.py) equals
the attention one process runs over the whole rows (the additive sliding-window bias of
models/attention.py build_bias, keys with q - k >= window hidden), output and q/k/v gradients. The ranks of
a ring of 2 and 4 run one after another in this process: a stand-in ring hands each rank the K/V of the
rank before it at each step and keeps the K/V gradient accumulators each rank sends on, which are summed by
the K/V they belong to (what the travelling accumulators carry home). Both pair paths run: the fused CPU
kernel per chunk pair and the blocks of Paddle ops (blocks of 4 tokens: key blocks outside the window are
skipped too); windows shorter than a chunk (whole chunk pairs skipped), spanning chunks, and as long as the
rows; packed rows and grouped-query heads."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import paddle
import pytest

from bmtrain_cli.models.attention import build_bias, eager_attention, repeat_kv
from bmtrain_cli.models.attention_choice import ScoreRule
from bmtrain_cli.parallel.ring_attention import RingCore, local_indices
from bmtrain_cli.parallel.ring_pairs import pair_list


class _SimulatedRing:
    """Rank ``rank`` of a ring of ``degree`` whose neighbours' K/V are known in advance: a K/V exchange at
    step t returns rank (rank - t - 1)'s K/V in the layout sent (the pairs' [2, b, 2c, hk, d] or the
    blocks' [2, b, hk, 2c, d]); an accumulator exchange at step t records what is sent as this rank's
    share of rank (rank - t)'s K/V gradients and returns zeros."""

    def __init__(self, rank: int, degree: int, shares: List[Any]) -> None:
        self.rank, self.degree, self.ranks = rank, degree, list(range(degree))
        self.shares = shares  # per rank: (k, v) numpy [b, 2c, hk, d]
        self.kv_calls = self.acc_calls = 0
        self.sent: Dict[int, List[np.ndarray]] = {}

    def exchange(self, tensors: List[paddle.Tensor]) -> List[paddle.Tensor]:
        if len(tensors) == 1:
            t = self.kv_calls % (self.degree - 1)
            self.kv_calls += 1
            k, v = self.shares[(self.rank - t - 1) % self.degree]
            kv = np.stack([k, v])
            if tensors[0].shape[2] != k.shape[1]:  # the blocks' layout
                kv = kv.transpose([0, 1, 3, 2, 4])
            return [paddle.to_tensor(kv.astype(tensors[0].numpy().dtype))]
        owner = (self.rank - self.acc_calls % self.degree) % self.degree
        self.acc_calls += 1
        got = [t.numpy() for t in tensors]
        if tensors[0].shape[1] != self.shares[0][0].shape[1]:  # the blocks' [b, hk, 2c, d]
            got = [g.transpose([0, 2, 1, 3]) for g in got]
        self.sent[owner] = got
        return [paddle.zeros_like(t) for t in tensors]


def _problem(seq: int, packed: bool):
    rng = np.random.default_rng(seq)
    q, w = (rng.standard_normal((2, seq, 4, 8)).astype("float32") for _ in range(2))
    k, v = (rng.standard_normal((2, seq, 2, 8)).astype("float32") for _ in range(2))
    seg = None
    if packed:
        seg = np.ones((2, seq), dtype="int64")
        seg[0, seq // 3 :] = 2
        seg[0, seq // 2 + 1 :] = 3
        seg[1, seq - 5 :] = 0
    return q, k, v, w, seg


def _whole(q, k, v, w, seg, window):
    """One process: the sliding-window bias over the whole rows (models/attention.py build_bias)."""
    ts = [paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v)]
    s = q.shape[1]
    seg_t = None if seg is None else paddle.to_tensor(seg)
    bias = build_bias(seg_t, seg_t, s, s, 0, "float32", window)
    out = eager_attention(ts[0], repeat_kv(ts[1], 2), repeat_kv(ts[2], 2), bias, 8**-0.5)
    (out * paddle.to_tensor(w)).sum().backward()
    return [out.numpy()] + [t.grad.numpy() for t in ts]


def _ring(q, k, v, w, seg, window, degree, fused, softcap=None):
    """Every rank of the ring in turn (``softcap``: the scores' cap, test_ring_softcap.py); the pieces put
    back in the rows' order."""
    s = q.shape[1]
    idx = [local_indices(s, degree, r) for r in range(degree)]
    shares = [(k[:, i], v[:, i]) for i in idx]
    got = [np.zeros_like(x) for x in (w, q, k, v)]
    for r in range(degree):
        ring = _SimulatedRing(r, degree, shares)
        ts = [paddle.to_tensor(x[:, idx[r]], stop_gradient=False) for x in (q, k, v)]
        core = RingCore(ring, block=4, fused=fused)
        out = core(*ts, None if seg is None else paddle.to_tensor(seg), rule=ScoreRule(window, softcap))
        (out * paddle.to_tensor(w[:, idx[r]])).sum().backward()
        got[0][:, idx[r]] = out.numpy()
        got[1][:, idx[r]] = ts[0].grad.numpy()
        assert len(ring.sent) == degree
        for owner, (dk, dv) in ring.sent.items():
            got[2][:, idx[owner]] += dk
            got[3][:, idx[owner]] += dv
    return got


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    "degree,window,packed",
    [(2, 4, False), (2, 13, True), (4, 3, True), (4, 9, False), (4, 100, True)],
)
def test_windowed_ring_equals_whole_rows(ext, fused, degree, window, packed):
    seq = 40 if degree == 2 else 48  # chunks of 10 / 6 tokens
    q, k, v, w, seg = _problem(seq, packed)
    want = _whole(q, k, v, w, seg, window)
    got = _ring(q, k, v, w, seg, window, degree, fused)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


def test_chunk_pairs_outside_the_window_are_skipped():
    # rank 0 of 2 (chunks 0 and 3 of 10 tokens) meets its own K/V: the back chunk's pair with the front
    # chunk has its nearest key 21 positions back
    assert pair_list((0, 3), (0, 3), 10, None) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    assert pair_list((0, 3), (0, 3), 10, 21) == [(0, 0, True), (1, 1, True)]
    assert pair_list((0, 3), (0, 3), 10, 22) == [(0, 0, True), (1, 0, False), (1, 1, True)]
    # rank 1's K/V (chunks 1 and 2) at rank 0: the back chunk sees chunk 2 (nearest key 1 back) and chunk
    # 1 (11 back)
    assert pair_list((0, 3), (1, 2), 10, 11) == [(1, 1, False)]
    assert pair_list((0, 3), (1, 2), 10, 12) == [(1, 0, False), (1, 1, False)]
