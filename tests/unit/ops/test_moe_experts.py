"""The MoE experts' grouped GEMM (ops/moe_experts.py over kernels/cpu/moe_cpu.cc): output, input gradient and
every expert's weight gradients equal the per-expert reference composition (Paddle's matmuls), over odd
sizes, experts without rows, one expert taking every row and sizes on the threaded path; the choice of
implementation by mode and device; a model trained with our kernels equals one with the reference."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.errors import NoticeWarning
from bmtrain_cli.models.moe import SparseMoE
from bmtrain_cli.ops import moe_experts, select
from bmtrain_cli.ops.moe_experts import choose, grouped_experts, reference_experts, resolve, swiglu_expert

# (hidden, inter, rows of each expert)
CASES = [
    (13, 7, [3, 0, 5, 1, 0]),  # odd sizes, experts without rows
    (16, 8, [0, 0, 9, 0]),  # one expert takes every row
    (5, 3, [1]),  # one expert, one row
    (33, 17, [130, 2, 0, 257]),  # several row tiles of one expert, odd counts
    (96, 80, [300, 0, 310]),  # rows x hidden x inter above the one-thread threshold: the threaded path
    (300, 260, [4, 6]),  # weight gradients in several row blocks
]


def _weights(h: int, f: int, experts: int, seed: int):
    rng = np.random.default_rng(seed)

    def param(*shape):
        t = paddle.to_tensor(rng.standard_normal(shape) / np.sqrt(shape[0])).astype("float32")
        t.stop_gradient = False
        return t

    return (
        [param(h, f) for _ in range(experts)],
        [param(h, f) for _ in range(experts)],
        [param(f, h) for _ in range(experts)],
    )


def _run(fn, h, f, counts, seed=0):
    gate, up, down = _weights(h, f, len(counts), seed)
    rng = np.random.default_rng(seed + 1)
    x = paddle.to_tensor(rng.standard_normal((sum(counts), h))).astype("float32")
    x.stop_gradient = False
    dy = paddle.to_tensor(rng.standard_normal((sum(counts), h))).astype("float32")
    if fn is reference_experts:
        y = fn(x, counts, [swiglu_expert(*w) for w in zip(gate, up, down)])
    else:
        y = fn(x, counts, (gate, up, down))
    (y * dy).sum().backward()
    return [y.numpy(), x.grad.numpy()] + [w.grad.numpy() for w in gate + up + down]


@pytest.mark.parametrize("h,f,counts", CASES)
def test_grouped_gemm_equals_the_reference_composition(ext, h, f, counts):
    ours, ref = _run(grouped_experts, h, f, counts), _run(reference_experts, h, f, counts)
    assert len(ours) == len(ref) == 2 + 3 * len(counts)
    for i, (a, b) in enumerate(zip(ours, ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"output {i}")
    for e, n in enumerate(counts):  # an expert without rows: zero gradients, not missing
        if n == 0:
            assert all(not ours[2 + k * len(counts) + e].any() for k in range(3))


def test_frozen_experts_and_no_grad(ext):
    h, f, counts = 12, 6, [2, 0, 3]
    gate, up, down = _weights(h, f, 3, 4)
    for w in gate + up + down:
        w.stop_gradient = True
    x = paddle.randn([5, h], "float32")
    x.stop_gradient = False
    y = grouped_experts(x, counts, (gate, up, down))
    y.sum().backward()
    xr = paddle.to_tensor(x.numpy())
    xr.stop_gradient = False
    ref = reference_experts(xr, counts, [swiglu_expert(*w) for w in zip(gate, up, down)])
    ref.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert all(w.grad is None for w in gate + up + down)
    with paddle.no_grad():
        np.testing.assert_allclose(
            grouped_experts(x, counts, (gate, up, down)).numpy(), ref.numpy(), rtol=1e-4, atol=1e-5
        )


def test_errors(ext):
    gate, up, down = _weights(4, 2, 2, 0)
    with pytest.raises(ValueError, match="float32"):
        grouped_experts(paddle.zeros([3, 4], "float64"), [1, 2], (gate, up, down))
    with pytest.raises(ValueError, match="sum to 2"):
        grouped_experts(paddle.zeros([3, 4], "float32"), [1, 1], (gate, up, down))
    with pytest.raises(ValueError, match="counts"):
        grouped_experts(paddle.zeros([3, 4], "float32"), [3], (gate, up, down))
    with pytest.raises(ValueError, match="float32"):
        grouped_experts(
            paddle.zeros([3, 4], "float32"), [1, 2], (gate, up, [w.astype("float64") for w in down])
        )


def test_choice_by_mode_and_device():
    assert choose("auto", "cpu", True)[0] == "grouped"
    assert choose("custom", "cpu", True)[0] == "grouped"
    assert choose("auto", "cpu", False)[0] == "reference"
    assert choose("paddle", "cpu", True)[0] == "reference"
    assert choose("reference", "cpu", True)[0] == "reference"
    impl, why = choose("auto", "gpu:0", True)
    assert impl == "reference" and "gpu:0" in why and "fused_moe" in why


def test_a_gpu_layer_says_once_that_it_runs_the_reference(monkeypatch):
    monkeypatch.setattr(moe_experts, "_told", set())
    with pytest.warns(NoticeWarning, match="MoE experts: no grouped-GEMM training op .* on gpu:0"):
        assert resolve(None, "auto", "gpu:0") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(None, "auto", "gpu:0") is None  # once per process and reason
        assert resolve(None, "reference", "cpu") is None  # a CPU without our kernels: no line
        assert resolve(grouped_experts, "auto", "cpu") is grouped_experts


def test_op_sets_carry_the_grouped_gemm_where_our_cpu_kernels_run(ext):
    assert select("custom", device="cpu").moe_experts is grouped_experts
    assert select("reference", device="cpu").moe_experts is None
    assert select("paddle", device="cpu").moe_experts is None


def test_an_moe_layer_trains_the_same_with_the_grouped_gemm(ext):
    """SparseMoE's forward and gradients with ``kernels: custom`` (the grouped GEMM) equal those with
    ``reference`` (the per-expert Expert layers)."""
    from tests.unit.models.test_moe import _fresh_arch

    arch = replace(_fresh_arch(), num_experts=6, num_experts_per_tok=3)
    x = paddle.randn([2, 7, arch.hidden_size], "float32")
    results = []
    for mode in ("custom", "reference"):
        paddle.seed(3)
        layer = SparseMoE(arch, select(mode, device="cpu"))
        layer.to(dtype="float32")
        assert (layer.grouped is not None) == (mode == "custom")
        y = layer(x)
        (y * y).sum().backward()
        results.append([y.numpy()] + [p.grad.numpy() for p in layer.parameters() if p.grad is not None])
    assert len(results[0]) == len(results[1]) == 1 + 1 + 3 * 6  # router and every expert
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
