"""The fused CPU attention's ring block-pair mode (ops/fused_attention.py attention_pair_forward/_backward)
against dense Paddle ops: causal (diagonal) and non-causal (a key chunk before the query chunk) pairs,
separate query and key segment ids (queries whose segment has no key in the pair: output 0, lse -1e30),
grouped-query / multi-query / multi-head, odd and unequal lengths, float32 and float64; the backward's
FlashAttention-2 recurrences against a given (global) log-sum-exp and D. Then the ring itself
(parallel/ring_attention.py, one process) with the fused kernel per chunk pair against its Paddle-op blocks,
output and q/k/v gradients."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops.fused_attention import Pair, attention_pair_backward, attention_pair_forward
from bmtrain_cli.parallel.ring_attention import Ring, RingCore
from bmtrain_cli.parallel.ring_pairs import FusedPairs, pair_kernel


def _visible(sq, sk, causal, segs, window=0, offset=0):
    """Boolean [b or 1, 1, sq, sk]: which keys each query sees (window > 0: query i, offset positions after
    key 0, sees only the keys j with i + offset - j < window)."""
    allowed = np.ones((1, sq, sk), dtype=bool)
    if causal:
        allowed = allowed & (np.arange(sk)[None, :] <= np.arange(sq)[:, None])[None]
    if window:
        allowed = allowed & ((np.arange(sq)[:, None] + offset - np.arange(sk)[None, :]) < window)[None]
    if segs is not None:
        allowed = allowed & (segs[0][:, :, None] == segs[1][:, None, :])
    return paddle.to_tensor(allowed[:, None])


def _dense(q, k, v, segs, causal, scale, window=0, offset=0):
    """Scores, probabilities, output, lse with Paddle ops: q [b, sq, h, d], k/v [b, sk, hk, d]."""
    rep = q.shape[2] // k.shape[2]
    qh = q.transpose([0, 2, 1, 3])
    kh = paddle.repeat_interleave(k, rep, axis=2).transpose([0, 2, 1, 3])
    vh = paddle.repeat_interleave(v, rep, axis=2).transpose([0, 2, 1, 3])
    allowed = _visible(q.shape[1], k.shape[1], causal, segs, window, offset)
    s = paddle.matmul(qh, kh, transpose_y=True) * scale
    s = paddle.where(allowed, s, paddle.full([1], -np.inf, dtype=s.dtype))
    lse = paddle.logsumexp(s, axis=-1)  # [b, h, sq]
    empty = ~allowed.any(axis=-1)
    lse = paddle.where(empty, paddle.full([1], -1e30, dtype=lse.dtype), lse)
    p = paddle.where(allowed, paddle.exp(s - lse.unsqueeze(-1)), paddle.zeros([1], dtype=s.dtype))
    out = paddle.matmul(p, vh).transpose([0, 2, 1, 3])
    return qh, kh, vh, allowed, out, lse


def _dense_backward(q, k, v, segs, causal, scale, lse, delta, dout, window=0, offset=0):
    """The FA2 recurrences against ``lse``/``delta`` [b, h, sq], in dense Paddle ops; K/V grads summed over
    the query heads of each KV head."""
    qh, kh, vh, allowed, _, _ = _dense(q, k, v, segs, causal, scale, window, offset)
    s = paddle.matmul(qh, kh, transpose_y=True) * scale
    p = paddle.where(allowed, paddle.exp(s - lse.unsqueeze(-1)), paddle.zeros([1], dtype=s.dtype))
    do = dout.transpose([0, 2, 1, 3])
    dp = paddle.matmul(do, vh, transpose_y=True)
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = paddle.matmul(ds, kh).transpose([0, 2, 1, 3])
    b, h, sk, d = kh.shape
    hk = k.shape[2]
    dk = paddle.matmul(ds, qh, transpose_x=True).reshape([b, hk, h // hk, sk, d]).sum(2)
    dv = paddle.matmul(p, do, transpose_x=True).reshape([b, hk, h // hk, sk, d]).sum(2)
    return dq, dk.transpose([0, 2, 1, 3]), dv.transpose([0, 2, 1, 3])


def _segments(b, n, rng, first):
    """Sorted packed ids per row, starting at ``first`` (a key chunk's ids run before its query chunk's)."""
    return np.sort(first + rng.integers(0, 3, size=(b, n)), axis=1).astype("int64")


# (batch, q_len, k_len, heads, kv_heads, head_dim, causal, segmented)
SHAPES = [
    (2, 13, 13, 4, 2, 8, True, False),
    (2, 13, 13, 4, 2, 8, True, True),
    (1, 11, 19, 3, 1, 16, False, False),
    (2, 11, 19, 4, 2, 8, False, True),
    (1, 40, 40, 2, 2, 24, True, True),
    (3, 9, 33, 6, 3, 8, False, True),
    (1, 1, 1, 2, 1, 8, True, False),
    # above parallel.h's threshold: the OpenMP path, chunked (1 x 3 KV heads) with per-chunk K/V gradients
    (1, 150, 170, 9, 3, 64, False, True),
    (1, 190, 190, 9, 3, 64, True, True),
]


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("float64", 1e-10)])
@pytest.mark.parametrize("shape", SHAPES)
def test_pair_forward_and_backward_match_dense_ops(ext, shape, dtype, tol):
    _check_pair_against_dense(shape, dtype, tol)


# (batch, q_len, k_len, heads, kv_heads, head_dim, causal, segmented, window, offset): the window inside
# one chunk (causal pair) or reaching back over part of an earlier chunk, over more than one score tile,
# cutting every key of some queries (output 0, lse -1e30), with packed segments, grouped-query heads and
# odd lengths; then the OpenMP path
WINDOWED = [
    (2, 13, 13, 4, 2, 8, True, False, 4, 0),
    (2, 13, 13, 4, 2, 8, True, True, 1, 0),
    (1, 40, 40, 2, 2, 24, True, True, 19, 0),
    (1, 11, 19, 3, 1, 16, False, False, 7, 19),
    (2, 11, 19, 4, 2, 8, False, True, 25, 19),
    (3, 9, 33, 6, 3, 8, False, True, 30, 33),
    (1, 17, 17, 2, 1, 8, False, False, 20, 34),
    (1, 190, 190, 9, 3, 64, True, True, 37, 0),
    (1, 150, 170, 9, 3, 64, False, True, 100, 170),
]


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-5), ("float64", 1e-10)])
@pytest.mark.parametrize("shape", WINDOWED)
def test_windowed_pair_matches_dense_ops(ext, shape, dtype, tol):
    _check_pair_against_dense(shape, dtype, tol)


def _check_pair_against_dense(shape, dtype, tol):
    b, sq, sk, h, hk, d, causal, segmented, *window = shape
    window, offset = window or (0, 0)
    rng = np.random.default_rng(sq * 31 + sk)
    q, dout = (paddle.to_tensor(rng.standard_normal((b, sq, h, d)).astype(dtype)) for _ in range(2))
    k, v = (paddle.to_tensor(rng.standard_normal((b, sk, hk, d)).astype(dtype)) for _ in range(2))
    segs = None
    if segmented:
        kseg = _segments(b, sk, rng, 0)
        qseg = kseg[:, :sq].copy() if causal else _segments(b, sq, rng, 2)  # id 4: no key of the pair
        segs = (qseg, kseg)
    seg_t = None if segs is None else tuple(paddle.to_tensor(x) for x in segs)
    scale = d**-0.5
    pair = Pair(q, k, v, seg_t, causal, scale, window, offset)
    out, lse = attention_pair_forward(pair)
    _, _, _, allowed, ref_out, ref_lse = _dense(q, k, v, segs, causal, scale, window, offset)
    np.testing.assert_allclose(out.numpy(), ref_out.numpy(), atol=tol, rtol=tol)
    np.testing.assert_allclose(lse.numpy(), ref_lse.numpy(), atol=tol, rtol=tol)
    if (segmented and not causal) or window > 1:
        assert (~allowed.numpy().all(-1)).any()  # the mask cuts: some keys of some queries are hidden
    # the backward against a global lse (this pair's merged with another share) and an arbitrary D
    other = paddle.to_tensor(rng.standard_normal(lse.shape).astype(dtype))
    glob = paddle.logaddexp(ref_lse, other)
    delta = paddle.to_tensor(rng.standard_normal(lse.shape).astype(dtype))
    grads = attention_pair_backward(pair, glob, delta, dout)
    refs = _dense_backward(q, k, v, segs, causal, scale, glob, delta, dout, window, offset)
    for name, g, r in zip("qkv", grads, refs):
        np.testing.assert_allclose(g.numpy(), r.numpy(), atol=tol, rtol=tol, err_msg=f"d{name}")


def test_pair_refuses_a_causal_pair_of_unequal_lengths(ext):
    q = paddle.zeros([1, 4, 2, 8])
    k = paddle.zeros([1, 6, 1, 8])
    with pytest.raises(ValueError, match="causal pair"):
        attention_pair_forward(Pair(q, k, k, None, True, 0.3))
    half = paddle.zeros([1, 4, 2, 8], "float16")
    with pytest.raises(ValueError, match=r"float32 or float64 on a CPU, got paddle.float16 on Place\(cpu\)"):
        attention_pair_forward(Pair(half, half, half, None, False, 0.3))
    with pytest.raises(ValueError, match=r"window must be positive \(0: none\), got -1"):
        attention_pair_forward(Pair(q, q, q, None, True, 0.3, -1))


def _ring_call(fused, q, k, v, seg, w):
    ts = [paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v)]
    core = RingCore(Ring(None, [0], 0), block=5, fused=fused)
    out = core(*ts, None if seg is None else paddle.to_tensor(seg))
    (out * paddle.to_tensor(w)).sum().backward()
    return [out.numpy()] + [t.grad.numpy() for t in ts]


@pytest.mark.parametrize("packed", [False, True])
def test_ring_fused_pairs_equal_paddle_op_blocks(ext, packed):
    """One process (a ring of one: the front chunk's causal pair, the back chunk's full pair with the
    front chunk and its own causal pair), grouped-query heads, chunks of 17 tokens."""
    rng = np.random.default_rng(3)
    s = 34
    q, w = (rng.standard_normal((2, s, 4, 8)).astype("float32") for _ in range(2))
    k, v = (rng.standard_normal((2, s, 2, 8)).astype("float32") for _ in range(2))
    seg = None
    if packed:
        seg = np.ones((2, s), dtype="int64")
        seg[0, 9:] = 2
        seg[0, 23:] = 3
        seg[1, 20:] = 0
    assert isinstance(pair_kernel(paddle.to_tensor(q), None, True), FusedPairs)
    assert pair_kernel(paddle.to_tensor(q), None, False) is None  # kernels: reference -> Paddle ops
    fused = _ring_call(True, q, k, v, seg, w)
    blocks = _ring_call(False, q, k, v, seg, w)
    for name, a, r in zip(["out", "dq", "dk", "dv"], fused, blocks):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5, err_msg=name)


def test_the_path_is_reported_once_with_the_reason(ext, capsys, monkeypatch):
    from bmtrain_cli.parallel import ring_pairs

    monkeypatch.setattr(ring_pairs, "_LOGGED", set())
    q = paddle.zeros([1, 4, 2, 8])
    for _ in range(2):
        pair_kernel(q, None, True, report=True)
        pair_kernel(q, None, False, report=True)
        pair_kernel(q.astype("float16"), None, True, report=True)
    pair_kernel(q, None, False)  # a later rank: silent
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "ring attention: the fused CPU attention kernel per chunk pair",
        "ring attention: blocks of Paddle ops (kernels: reference, or our kernels are not built)",
        "ring attention: blocks of Paddle ops (float16: the fused CPU kernel takes float32/float64)",
    ]
