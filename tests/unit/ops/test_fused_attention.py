"""The fused CPU attention core (ops/fused_attention.py) against the eager reference of models/attention.py:
forward and the gradients of q, k and v, causal and by segment ids (several segments, padding, ids that
recur after another segment), grouped-query / multi-head / multi-query heads, odd lengths, one token, and
the threaded path; float64 to 1e-10; the error cases."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.models.attention import build_bias, eager_attention, repeat_kv
from bmtrain_cli.ops.fused_attention import fused_attention


def _t(a: np.ndarray, grad: bool = True) -> paddle.Tensor:
    x = paddle.to_tensor(a)
    x.stop_gradient = not grad
    return x


def _segments(b: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """Per row: left padding (segment 0), then 3 packed segments of random lengths, trailing padding in the
    middle row, and in the last row an id that recurs after another segment."""
    seg = np.zeros((b, s), dtype="int64")
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s), size=min(3, s - 1), replace=False)) if s > 1 else []
        ids, start = 1, 0
        for c in list(cuts) + [s]:
            seg[r, start:c] = ids
            ids, start = ids + 1, c
        seg[r, : min(2, s - 1)] = 0  # left padding
        if r == 1 and s > 4:
            seg[r, -2:] = 0  # trailing padding too
        if r == 2 and s > 6:
            seg[r, -3:] = 1  # segment 1 again after others: equality, not contiguity, decides
    return seg


def _reference(q, k, v, seg):
    rep = q.shape[2] // k.shape[2]
    s = q.shape[1]
    bias = None if seg is None else build_bias(seg, seg, s, s, 0, q.dtype)
    k, v, scale = repeat_kv(k, rep), repeat_kv(v, rep), float(q.shape[-1]) ** -0.5
    if q.dtype == paddle.float32:
        return eager_attention(q, k, v, bias, scale)
    # eager_attention's softmax is fp32: the same maths in float64
    bias = build_bias(seg, seg, s, s, 0, q.dtype)
    qt, kt, vt = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    probs = paddle.nn.functional.softmax(paddle.matmul(qt, kt, transpose_y=True) * scale + bias, axis=-1)
    return paddle.matmul(probs, vt).transpose([0, 2, 1, 3])


def _compare(b, s, h, hk, d, masked, dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    q = _t(rng.standard_normal((b, s, h, d)).astype(dtype))
    k = _t(rng.standard_normal((b, s, hk, d)).astype(dtype))
    v = _t(rng.standard_normal((b, s, hk, d)).astype(dtype))
    seg = paddle.to_tensor(_segments(b, s, rng)) if masked else None
    got, want = fused_attention(q, k, v, seg), _reference(q, k, v, seg)
    g = paddle.to_tensor(rng.standard_normal((b, s, h, d)).astype(dtype))
    tol = 1e-10 if dtype == "float64" else 1e-5
    pairs = [(got, want)] + list(zip(paddle.grad([got], [q, k, v], [g]), paddle.grad([want], [q, k, v], [g])))
    for name, (a, r) in zip(("out", "dq", "dk", "dv"), pairs):
        a, r = a.numpy().astype("float64"), r.numpy().astype("float64")
        scale = max(1.0, float(np.abs(r).max()))
        err = float(np.abs(a - r).max())
        assert err <= tol * scale, f"{name}: max abs error {err} (scale {scale})"


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "segments"])
@pytest.mark.parametrize("h,hk", [(9, 3), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("b,s", [(1, 37), (3, 21), (3, 1)])
def test_matches_eager(b, s, h, hk, masked):
    _compare(b, s, h, hk, 64, masked)


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "segments"])
def test_threaded_shape(masked):
    # 2 x 9 heads x 190 tokens: above parallel.h's threshold, so the OpenMP path runs (and, with 1 x 3 kv
    # heads on 2 threads, the chunked path with its per-chunk K/V gradients)
    _compare(2, 190, 9, 3, 64, masked, seed=1)
    _compare(1, 300, 6, 3, 64, masked, seed=2)


def test_float64_and_odd_head_dim():
    _compare(2, 45, 4, 2, 40, True, dtype="float64")
    _compare(1, 33, 2, 1, 24, False)


def test_the_mask_is_used():
    # the same inputs with and without segment ids differ: the segments path is really taken
    rng = np.random.default_rng(3)
    q, k, v = (_t(rng.standard_normal((1, 20, 2, 16)).astype("float32"), False) for _ in range(3))
    seg = paddle.to_tensor(np.repeat([[1, 2]], 10, axis=1).reshape(1, 20).astype("int64"))
    assert float((fused_attention(q, k, v) - fused_attention(q, k, v, seg)).abs().max()) > 1e-2


def test_no_grad_forward_matches():
    rng = np.random.default_rng(4)
    q, k, v = (_t(rng.standard_normal((2, 17, 4, 16)).astype("float32")) for _ in range(3))
    with paddle.no_grad():
        plain = fused_attention(q, k, v)
    np.testing.assert_allclose(plain.numpy(), _reference(q, k, v, None).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "shapes,dtype,seg_shape,match",
    [
        (((1, 4, 4, 8), (1, 4, 3, 8), (1, 4, 3, 8)), "float32", None, "divide"),
        (((1, 4, 4, 8), (1, 5, 2, 8), (1, 5, 2, 8)), "float32", None, "do not fit"),
        (((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 1, 8)), "float32", None, "kv_heads"),
        (((4, 4, 8), (4, 2, 8), (4, 2, 8)), "float32", None, "batch, seq"),
        (((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "float16", None, "float32 or float64"),
        (((1, 4, 4, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "float32", (1, 5), "segment ids"),
    ],
)
def test_errors(shapes, dtype, seg_shape, match):
    q, k, v = (paddle.zeros(s, dtype=dtype) for s in shapes)
    seg = None if seg_shape is None else paddle.zeros(seg_shape, dtype="int64")
    with pytest.raises(ValueError, match=match):
        fused_attention(q, k, v, seg)
