"""ops/fused_adamw.adamw_multi_ (kernels/cpu/adamw_cpu.cc) against the AdamW formula in numpy, and its checks."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops.fused_adamw import adamw_multi_

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def _numpy_adamw(p, g, m, v, lr, b1, b2, eps, wd, b1p, b2p):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * math.sqrt(1 - b2p) / (1 - b1p)
    return p - step * m / (np.sqrt(v) + eps * math.sqrt(1 - b2p)), m, v


def _run(sizes, dtype, steps, scale, first_t=None):
    """``steps`` fused steps of tensors of ``sizes`` against numpy; tensor i starts at step first_t[i]."""
    rng = np.random.RandomState(0)
    first_t = first_t or [1] * len(sizes)
    ref = [[rng.randn(n).astype(dtype), np.zeros(n, dtype), np.zeros(n, dtype)] for n in sizes]
    tens = [[paddle.to_tensor(a.copy()) for a in r] for r in ref]
    pows = [[paddle.to_tensor(np.array([b**t], dtype)) for b in (B1, B2)] for t in first_t]
    lr = 3e-3
    for k in range(steps):
        grads = [rng.randn(n).astype(dtype) for n in sizes]
        for i, g in enumerate(grads):
            t = first_t[i] + k
            ref[i] = list(
                _numpy_adamw(*ref[i][:1], g * scale, *ref[i][1:], lr * (k + 1), B1, B2, EPS, WD, B1**t, B2**t)
            )
        tg = [paddle.to_tensor(g) for g in grads]
        adamw_multi_(
            [t[0] for t in tens], tg, [t[1] for t in tens], [t[2] for t in tens],
            [p[0] for p in pows], [p[1] for p in pows],
            lr=lr * (k + 1), beta1=B1, beta2=B2, epsilon=EPS, weight_decay=WD, grad_scale=scale,
        )  # fmt: skip
        for g, t in zip(grads, tg):
            np.testing.assert_array_equal(t.numpy(), g)  # the gradients are read, not written
    return ref, tens, pows


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "sizes",
    [[1], [4097, 1, (1 << 16) + 3, 1 << 17], [3 << 20, (1 << 20) + 5]],
    ids=["one", "chunk_edges", "threaded_by_total"],  # the last: each below kParallelMin, the sum above
)
def test_three_steps_equal_the_formula(dtype, sizes):
    ref, tens, pows = _run(sizes, dtype, steps=3, scale=0.37)
    tol = 1e-6 if dtype == "float32" else 1e-12  # the scalars reach the kernel as doubles
    for r, t in zip(ref, tens):
        for a, b in zip(r, t):
            np.testing.assert_allclose(b.numpy(), a, rtol=tol, atol=tol)
    for b1p, b2p in pows:  # advanced to beta^4
        np.testing.assert_allclose(b1p.numpy(), [B1**4], rtol=tol)
        np.testing.assert_allclose(b2p.numpy(), [B2**4], rtol=tol)


def test_each_tensor_uses_its_own_beta_powers():
    """Tensors of one call at different steps (a parameter that had no gradient for a while)."""
    ref, tens, pows = _run([64, 64], "float64", steps=2, scale=1.0, first_t=[1, 5])
    for r, t in zip(ref, tens):
        np.testing.assert_allclose(t[0].numpy(), r[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(pows[1][0].numpy(), [B1**7], rtol=1e-12)


def test_updates_a_parameter_in_place_under_autograd():
    lin = paddle.nn.Linear(8, 8)
    before = lin.weight.numpy().copy()
    (lin(paddle.ones([2, 8])).sum()).backward()
    m, v = paddle.zeros_like(lin.weight), paddle.zeros_like(lin.weight)
    b1p, b2p = paddle.full([1], 0.9), paddle.full([1], 0.99)
    with paddle.no_grad():
        adamw_multi_(
            [lin.weight], [lin.weight.grad], [m], [v], [b1p], [b2p], lr=0.1, beta1=0.9, beta2=0.99,
            epsilon=1e-8, weight_decay=0.0,
        )  # fmt: skip
    assert np.abs(lin.weight.numpy() - before).max() > 0.05
    assert float(m.abs().max()) > 0
    assert float(b1p.numpy()[0]) == pytest.approx(0.81)


def _call(p, g, m, v, b1p=None, b2p=None, **over):
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.0)
    kw.update(over)
    one = paddle.full([1], 0.5, p.dtype)
    adamw_multi_(
        [p], [g], [m], [v], [b1p if b1p is not None else one], [b2p if b2p is not None else one], **kw
    )


def test_refuses_bad_operands():
    z = paddle.zeros([4])
    with pytest.raises(ValueError, match="grad 0 is paddle.float64"):
        _call(z, paddle.zeros([4], "float64"), z.clone(), z.clone())
    with pytest.raises(ValueError, match=r"moment2 0 is paddle.float32 \[5\]"):
        _call(z, z.clone(), z.clone(), paddle.zeros([5]))
    with pytest.raises(ValueError, match="takes float32/float64"):
        i = paddle.zeros([4], "int32")
        _call(i, i, i, i, paddle.zeros([1], "int32"), paddle.zeros([1], "int32"))
    with pytest.raises(ValueError, match="betas must lie in"):
        _call(z, z.clone(), z.clone(), z.clone(), beta2=1.0)
    with pytest.raises(ValueError, match="grad_scale finite"):
        _call(z, z.clone(), z.clone(), z.clone(), grad_scale=float("nan"))
    with pytest.raises(ValueError, match="1 grads for 2 parameters"):
        adamw_multi_([z, z], [z], [z, z], [z, z], [z, z], [z, z], lr=1e-3, beta1=0.9, beta2=0.9, epsilon=1e-8,
                     weight_decay=0.0)  # fmt: skip
    with pytest.raises(Exception, match=r"beta1_pow\[0\] has 4 elements, expected 1"):
        _call(z, z.clone(), z.clone(), z.clone(), b1p=paddle.zeros([4]))


def test_a_beta_power_out_of_range_writes_nothing():
    p, m = paddle.ones([4]), paddle.ones([4])
    with pytest.raises(Exception, match=r"beta power lies outside \[0, 1\)"):
        adamw_multi_(
            [p, p.clone()], [paddle.ones([4])] * 2, [m, m.clone()], [paddle.ones([4]), paddle.ones([4])],
            [paddle.full([1], 0.5), paddle.full([1], 1.0)], [paddle.full([1], 0.5)] * 2,
            lr=0.1, beta1=0.9, beta2=0.9, epsilon=1e-8, weight_decay=0.0,
        )  # fmt: skip
    np.testing.assert_array_equal(p.numpy(), np.ones(4, "float32"))
    np.testing.assert_array_equal(m.numpy(), np.ones(4, "float32"))
