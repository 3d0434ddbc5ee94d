"""ops/grad_norm.sum_squares (kernels/cpu/grad_norm_cpu.cc) and the global gradient norm + clip it feeds,
against numpy in float64 and against Paddle's square + sum path."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops import grad_norm as gn
from bmtrain_cli.train.optimizer.adamw import clip_grads_, grad_norm_tensor

# odd sizes, an empty-ish one, and one above the kernel's 4Mi-element threading threshold
SIZES = [(1,), (7, 13), (257, 129), (5 << 20,)]


def _tensors(dtype: str = "float32", seed: int = 0):
    rng = np.random.default_rng(seed)
    return [paddle.to_tensor(rng.standard_normal(s).astype(dtype)) for s in SIZES]


def test_sum_squares_matches_numpy_float64_on_the_threaded_path(ext):
    xs = _tensors()
    expected = sum(float((x.numpy().astype(np.float64) ** 2).sum()) for x in xs)
    total, rest = gn.sum_squares(xs)
    assert rest == []
    assert float(total) == pytest.approx(expected, rel=1e-6)


def test_sum_squares_groups_dtypes_and_leaves_half_precision_to_the_caller(ext):
    f32, f64 = _tensors("float32", 1)[:3], _tensors("float64", 2)[:3]
    half = paddle.ones([4], dtype="float16")
    total, rest = gn.sum_squares(f32 + [half] + f64)
    expected = sum(float((x.numpy().astype(np.float64) ** 2).sum()) for x in f32 + f64)
    assert float(total) == pytest.approx(expected, rel=1e-6)
    assert len(rest) == 1 and rest[0] is half
    assert gn.sum_squares([half]) == (None, [half])


def test_sum_squares_of_a_non_contiguous_view(ext):
    x = paddle.to_tensor(np.arange(12, dtype="float32").reshape(3, 4)).transpose([1, 0])
    assert float(gn.sum_squares([x])[0]) == pytest.approx(float((np.arange(12.0) ** 2).sum()))


def test_the_operator_refuses_mixed_dtypes(ext):
    with pytest.raises(Exception, match="another dtype"):
        ext.bmt_sum_squares([paddle.ones([2], "float32"), paddle.ones([2], "float64")])


class _Params:
    """Parameters with the given gradients, as train/optim sees them (p.grad)."""

    def __init__(self, seed: int) -> None:
        paddle.seed(seed)
        self.params = []
        for s in SIZES:
            p = paddle.create_parameter(list(s), "float32")
            (p * paddle.randn(list(s))).sum().backward()
            self.params.append(p)


def test_norm_and_a_clip_that_fires_equal_the_paddle_path(ext, monkeypatch):
    fused, plain = _Params(3), _Params(3)
    norm_fused = float(grad_norm_tensor(fused.params))
    monkeypatch.setattr(gn, "kernel_available", lambda: False)
    norm_plain = float(grad_norm_tensor(plain.params))
    assert abs(norm_fused - norm_plain) <= 1e-6 * norm_plain
    max_norm = norm_plain / 3  # the clip fires
    assert clip_grads_(fused.params, max_norm, norm_fused) < 0.34
    clip_grads_(plain.params, max_norm, norm_plain)
    for a, b in zip(fused.params, plain.params):
        np.testing.assert_allclose(a.grad.numpy(), b.grad.numpy(), rtol=1e-6, atol=1e-9)
    monkeypatch.undo()
    assert float(grad_norm_tensor(fused.params)) == pytest.approx(max_norm, rel=1e-5)


def test_a_non_finite_gradient_gives_a_non_finite_norm(ext):
    ps = _Params(4).params
    with paddle.no_grad():
        ps[2].grad[0, 0] = float("inf")
    assert not np.isfinite(float(grad_norm_tensor(ps)))
    with paddle.no_grad():
        ps[2].grad[0, 0] = float("nan")
    assert np.isnan(float(grad_norm_tensor(ps)))
