"""Every custom kernel against the pure-Paddle reference: forward and every gradient, odd sizes, a single
row, long rows, float32 and float64 (the CPU kernels' dtypes), ignore labels.

Tolerances: max abs error <= tol * scale (scale = max(1, max |reference|)); tol 2e-5 for float32, 1e-10
for float64 where the reference is computed in float64 (rotary, swiglu) and 2e-5 where the reference
itself casts to float32 (RMSNorm statistics, cross-entropy); loss sums rtol 1e-5.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops import custom
from bmtrain_cli.ops import reference as ref

TOL = {"float32": 2e-5, "float64": 2e-5, "float64-exact": 1e-10}


def _t(a: np.ndarray, grad: bool = True) -> paddle.Tensor:
    x = paddle.to_tensor(a)
    x.stop_gradient = not grad
    return x


def _close(
    a: paddle.Tensor, b: paddle.Tensor, dtype: str, tol_scale: float = 1.0, exact64: bool = False
) -> None:
    if exact64 and dtype == "float64":
        dtype = "float64-exact"
    a, b = a.numpy().astype("float64"), b.numpy().astype("float64")
    assert a.shape == b.shape
    scale = max(1.0, float(np.abs(b).max(initial=0.0)))
    err = float(np.abs(a - b).max(initial=0.0))
    assert err <= TOL[dtype] * tol_scale * scale, f"max abs error {err} (scale {scale})"


def _grads(outs, inputs, upstream):
    return paddle.grad(outs, inputs, upstream, allow_unused=True)


# THREADED: above kernels/cpu/parallel.h's kParallelMin (4Mi elements), so OpenMP's threaded path runs
THREADED = (1025, 4097)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 33), (17, 4097), (2, 3, 64), THREADED])
def test_rms_norm(ext, dtype, shape):
    rng = np.random.default_rng(1)
    x = _t(rng.standard_normal(shape).astype(dtype) * 3)
    w = _t(rng.standard_normal(shape[-1:]).astype(dtype))
    y, yr = custom.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)
    _close(y, yr, dtype)
    g = paddle.to_tensor(rng.standard_normal(shape).astype(dtype))
    for a, b in zip(_grads([y], [x, w], [g]), _grads([yr], [x, w], [g])):
        _close(a, b, dtype, tol_scale=4)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "b,s,qh,kh,d,cos_b",
    [
        (1, 1, 1, 1, 2, 1),
        (2, 5, 3, 1, 8, 2),
        (2, 7, 4, 2, 128, 1),
        (1, 33, 5, 5, 6, 1),
        (3, 4, 2, 2, 64, 3),
        (1, 1025, 24, 8, 128, 1),  # threaded: 1025 x 32 heads x 128 > 4Mi elements
    ],
)
def test_rotary(ext, dtype, b, s, qh, kh, d, cos_b):
    rng = np.random.default_rng(2)
    q = _t(rng.standard_normal((b, s, qh, d)).astype(dtype))
    k = _t(rng.standard_normal((b, s, kh, d)).astype(dtype))
    ang = rng.standard_normal((cos_b, s, d // 2)) * 3
    ang = np.concatenate([ang, ang * 0.5], axis=-1)  # halves differ: checks the general formula
    cos, sin = _t(np.cos(ang).astype(dtype), False), _t(np.sin(ang).astype(dtype), False)
    out, out_r = custom.rotary(q, k, cos, sin), ref.rotary(q, k, cos, sin)
    for a, r in zip(out, out_r):
        _close(a, r, dtype, exact64=True)
    gq = paddle.to_tensor(rng.standard_normal(q.shape).astype(dtype))
    gk = paddle.to_tensor(rng.standard_normal(k.shape).astype(dtype))
    for a, r in zip(_grads(list(out), [q, k], [gq, gk]), _grads(list(out_r), [q, k], [gq, gk])):
        _close(a, r, dtype, exact64=True)


def test_rotary_only_q_used(ext):
    """A gradient that reaches only q_out (k_out unused) still gives q's gradient and a zero one for k."""
    rng = np.random.default_rng(3)
    q = _t(rng.standard_normal((1, 3, 2, 4)).astype("float32"))
    k = _t(rng.standard_normal((1, 3, 1, 4)).astype("float32"))
    cos, sin = _t(np.ones((1, 3, 4), "float32"), False), _t(np.zeros((1, 3, 4), "float32"), False)
    qo, _ = custom.rotary(q, k, cos, sin)
    qo.sum().backward()
    np.testing.assert_allclose(q.grad.numpy(), np.ones((1, 3, 2, 4)))
    assert k.grad is None or float(k.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(1,), (7, 33), (3, 5000), (2, 3, 4097), THREADED])
def test_swiglu(ext, dtype, shape):
    rng = np.random.default_rng(4)
    g = _t((rng.standard_normal(shape) * 8).astype(dtype))  # includes saturated sigmoid regions
    u = _t(rng.standard_normal(shape).astype(dtype))
    out, out_r = custom.swiglu(g, u), ref.swiglu(g, u)
    _close(out, out_r, dtype, exact64=True)
    go = paddle.to_tensor(rng.standard_normal(shape).astype(dtype))
    for a, r in zip(_grads([out], [g, u], [go]), _grads([out_r], [g, u], [go])):
        _close(a, r, dtype, exact64=True)


def _labels(rng, n, vocab, ignore_frac=0.25):
    lab = rng.integers(0, vocab, n).astype("int64")
    lab[rng.random(n) < ignore_frac] = -100
    return paddle.to_tensor(lab)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n,vocab", [(1, 2), (9, 101), (64, 5003), (3, 40000)])
def test_cross_entropy_sum(ext, dtype, n, vocab):
    rng = np.random.default_rng(5)
    logits = _t((rng.standard_normal((n, vocab)) * 4).astype(dtype))
    labels = _labels(rng, n, vocab)
    (s, c), (sr, cr) = custom.cross_entropy_sum(logits, labels), ref.cross_entropy_sum(logits, labels)
    assert s.dtype == paddle.float32 and float(c) == float(cr)
    np.testing.assert_allclose(float(s), float(sr), rtol=1e-5, atol=1e-5)
    (ga,), (gr,) = _grads([s * 1.7], [logits], None), _grads([sr * 1.7], [logits], None)
    _close(ga, gr, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    "n,hid,vocab,chunk", [(1, 3, 5, None), (37, 16, 101, 8), (50, 24, 1999, 1), (65, 8, 300, None)]
)
def test_linear_cross_entropy(ext, dtype, transpose, n, hid, vocab, chunk):
    rng = np.random.default_rng(6)
    h = _t(rng.standard_normal((n, hid)).astype(dtype))
    wshape = (vocab, hid) if transpose else (hid, vocab)
    w = _t((rng.standard_normal(wshape) / np.sqrt(hid)).astype(dtype))
    labels = _labels(rng, n, vocab)
    s, c = custom.linear_cross_entropy(h, w, labels, transpose_weight=transpose, chunk_tokens=chunk)
    sr, cr = ref.linear_cross_entropy(h, w, labels, transpose_weight=transpose)
    assert float(c) == float(cr)
    np.testing.assert_allclose(float(s), float(sr), rtol=1e-5, atol=1e-5)
    for a, r in zip(_grads([s * 0.5], [h, w], None), _grads([sr * 0.5], [h, w], None)):
        _close(a, r, dtype)


def test_linear_cross_entropy_all_ignored_and_frozen_weight(ext):
    rng = np.random.default_rng(7)
    h = _t(rng.standard_normal((6, 4)).astype("float32"))
    w = _t(rng.standard_normal((4, 9)).astype("float32"), grad=False)
    labels = paddle.full([6], -100, dtype="int64")
    s, c = custom.linear_cross_entropy(h, w, labels)
    assert float(s) == 0.0 and float(c) == 0.0
    s.backward()
    assert float(h.grad.abs().sum()) == 0.0 and w.grad is None
    labels = _labels(rng, 6, 9, 0.3)
    s, _ = custom.linear_cross_entropy(h, w, labels)
    (gh,) = paddle.grad([s], [h])
    (ghr,) = paddle.grad([ref.linear_cross_entropy(h, w, labels)[0]], [h])
    _close(gh, ghr, "float32")


def test_no_grad_paths_match(ext):
    rng = np.random.default_rng(8)
    h = _t(rng.standard_normal((20, 8)).astype("float32"))
    w = _t(rng.standard_normal((8, 77)).astype("float32"))
    labels = _labels(rng, 20, 77)
    with paddle.no_grad():
        s, c = custom.linear_cross_entropy(h, w, labels, chunk_tokens=3)
        s2, _ = custom.cross_entropy_sum(paddle.matmul(h, w), labels)
    sr, cr = ref.linear_cross_entropy(h, w, labels)
    np.testing.assert_allclose([float(s), float(s2)], [float(sr)] * 2, rtol=1e-5)
    assert float(c) == float(cr)


def test_non_contiguous_input_is_handled(ext):
    rng = np.random.default_rng(9)
    base = _t(rng.standard_normal((16, 8)).astype("float32"))
    x = base.transpose([1, 0])  # a view in Paddle 3
    w = _t(rng.standard_normal((16,)).astype("float32"))
    _close(custom.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), "float32")


def test_wrapper_errors_are_clear(ext):
    x = paddle.randn([4, 8])
    with pytest.raises(ValueError, match=r"rms_norm: weight must be \[8\]"):
        custom.rms_norm(x, paddle.randn([7]), 1e-6)
    with pytest.raises(ValueError, match="float32/float64"):
        custom.swiglu(x.astype("bfloat16"), x.astype("bfloat16"))
    with pytest.raises(ValueError, match="same shape"):
        custom.swiglu(x, paddle.randn([4, 9]))
    with pytest.raises(ValueError, match="cos/sin must be"):
        custom.rotary(
            paddle.randn([1, 3, 2, 4]),
            paddle.randn([1, 3, 2, 4]),
            paddle.randn([1, 2, 4]),
            paddle.randn([1, 2, 4]),
        )
    with pytest.raises(ValueError, match="does not match hidden"):
        custom.linear_cross_entropy(x, paddle.randn([9, 5]), paddle.zeros([4], "int64"))


def test_op_level_checks_and_bad_labels(ext):
    """The C++ operators check their own inputs too (direct callers get an error, never a crash)."""
    with pytest.raises(Exception, match="outside"):
        custom.cross_entropy_sum(paddle.randn([3, 5]), paddle.to_tensor([0, 5, 1]))
    with pytest.raises(Exception, match="weight must have shape"):
        ext.bmt_rms_norm(paddle.randn([2, 4]), paddle.randn([3]), 1e-6)
    with pytest.raises(Exception, match="int64"):
        ext.bmt_softmax_xent(paddle.randn([2, 4]), paddle.to_tensor([0, 1], dtype="int32"), -100)
