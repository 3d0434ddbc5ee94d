"""ops/fused_adamw.adamw_ (kernels/cpu/adamw_cpu.cc) against the AdamW formula in numpy, and its checks."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops.fused_adamw import adamw_


def _numpy_adamw(p, g, m, v, lr, b1, b2, eps, wd, b1p, b2p):
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    step = lr * math.sqrt(1 - b2p) / (1 - b1p)
    return p - step * m / (np.sqrt(v) + eps * math.sqrt(1 - b2p)), m, v


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n", [1, 4097, (1 << 22) + 3], ids=["one", "odd", "threaded"])
def test_three_steps_equal_the_formula(dtype, n):
    rng = np.random.RandomState(0)
    p, m, v = rng.randn(n).astype(dtype), np.zeros(n, dtype), np.zeros(n, dtype)
    tp, tm, tv = (paddle.to_tensor(a.copy()) for a in (p, m, v))
    b1, b2, lr, eps, wd = 0.9, 0.95, 3e-3, 1e-8, 0.1
    for t in range(1, 4):
        g = rng.randn(n).astype(dtype)
        p, m, v = _numpy_adamw(p, g, m, v, lr * t, b1, b2, eps, wd, b1**t, b2**t)
        adamw_(
            tp, paddle.to_tensor(g), tm, tv, lr=lr * t, beta1=b1, beta2=b2, epsilon=eps,
            weight_decay=wd, beta1_pow=b1**t, beta2_pow=b2**t,
        )  # fmt: skip
    tol = 1e-6 if dtype == "float32" else 1e-12  # the scalars reach the kernel as doubles
    np.testing.assert_allclose(tp.numpy(), p, rtol=tol, atol=tol)
    np.testing.assert_allclose(tm.numpy(), m, rtol=tol, atol=tol)
    np.testing.assert_allclose(tv.numpy(), v, rtol=tol, atol=tol)


def test_updates_a_parameter_in_place_under_autograd():
    lin = paddle.nn.Linear(8, 8)
    before = lin.weight.numpy().copy()
    (lin(paddle.ones([2, 8])).sum()).backward()
    m, v = paddle.zeros_like(lin.weight), paddle.zeros_like(lin.weight)
    with paddle.no_grad():
        adamw_(
            lin.weight, lin.weight.grad, m, v, lr=0.1, beta1=0.9, beta2=0.99, epsilon=1e-8,
            weight_decay=0.0, beta1_pow=0.9, beta2_pow=0.99,
        )  # fmt: skip
    assert np.abs(lin.weight.numpy() - before).max() > 0.05
    assert float(m.abs().max()) > 0


def _call(p, g, m, v, **over):
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.99, epsilon=1e-8, weight_decay=0.0, beta1_pow=0.9, beta2_pow=0.99)
    kw.update(over)
    adamw_(p, g, m, v, **kw)


def test_refuses_bad_operands():
    z = paddle.zeros([4])
    with pytest.raises(ValueError, match="grad is paddle.float64"):
        _call(z, paddle.zeros([4], "float64"), z.clone(), z.clone())
    with pytest.raises(ValueError, match=r"moment2 is paddle.float32 \[5\]"):
        _call(z, z.clone(), z.clone(), paddle.zeros([5]))
    with pytest.raises(ValueError, match="takes float32/float64"):
        i = paddle.zeros([4], "int32")
        _call(i, i, i, i)
    with pytest.raises(ValueError, match="must lie in"):
        _call(z, z.clone(), z.clone(), z.clone(), beta2_pow=1.0)
