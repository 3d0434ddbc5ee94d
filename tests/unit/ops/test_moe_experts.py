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
    assert choose("auto", "gpu:0", True)[0] == "grouped_cuda"  # tests/unit/ops/test_moe_cuda.py
    impl, why = choose("auto", "gpu:0", False)
    assert impl == "reference" and "gpu:0" in why and "fused_moe" in why


def test_a_gpu_layer_says_once_that_it_runs_the_reference(monkeypatch):
    monkeypatch.setattr(moe_experts, "_told", set())
    monkeypatch.setattr(moe_experts, "_why", {})
    with pytest.warns(NoticeWarning, match="MoE experts: kernels: auto on gpu:0 without our CUDA kernels"):
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


def test_rows_autocast_apart_from_their_weights_run_the_reference(ext, monkeypatch):
    """AMP O1 autocasts the rows (bf16 on a GPU) but not the fp32 weights: a grouped implementation that
    takes the rows' dtype (as the CUDA one takes bf16; ``takes`` patched so here) must not be handed
    weights of another dtype (its argument check refuses them): the layer runs the reference composition
    (recorded here: Paddle's CPU autocast does not cast its matmuls as a GPU's does)."""
    from bmtrain_cli.models import moe
    from tests.unit.models.test_moe import _fresh_arch

    arch = replace(_fresh_arch(), num_experts=4, num_experts_per_tok=2)
    layer = SparseMoE(arch, select("custom", device="cpu"))
    layer.to(dtype="float32")
    monkeypatch.setattr(moe, "takes", lambda grouped, dtype: True)
    calls = []
    monkeypatch.setattr(moe, "reference_experts", lambda rows, counts, experts: calls.append(counts) or rows)
    rows = paddle.randn([5, arch.hidden_size]).astype("bfloat16")
    assert layer._held_experts(rows, [2, 0, 3, 0]) is rows and calls == [[2, 0, 3, 0]]
    calls.clear()  # rows of the weights' dtype still take the grouped GEMM
    rows32 = rows.astype("float32")
    assert layer._held_experts(rows32, [2, 0, 3, 0]).shape == rows32.shape and calls == []


def test_the_launcher_without_mkl_equals_numpy(tmp_path):
    """kernels/cpu/moe_cpu.cc built alone without BMT_WITH_MKL (its own loops, where Paddle ships no MKL),
    called through its C ABI: forward and every gradient equal numpy in float64, experts without rows
    included."""
    import ctypes
    import subprocess

    from bmtrain_cli.machine import find_cxx
    from bmtrain_cli.ops.build import KERNELS_DIR

    cxx = find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    lib_path = tmp_path / "libmoe.so"
    subprocess.run(
        [cxx, "-O1", "-fopenmp", "-shared", "-fPIC", f"-I{KERNELS_DIR / 'include'}",
         str(KERNELS_DIR / "cpu" / "moe_cpu.cc"), "-o", str(lib_path)],
        check=True,
    )  # fmt: skip
    lib = ctypes.CDLL(str(lib_path))
    h, f, counts = 11, 6, [4, 0, 7]
    rng = np.random.default_rng(0)
    rows = sum(counts)
    x, dy = rng.standard_normal((rows, h)), rng.standard_normal((rows, h))
    ws = [[rng.standard_normal(s) / 3 for _ in counts] for s in ((h, f), (h, f), (f, h))]

    f32 = np.float32
    c = lambda a: np.ascontiguousarray(a, dtype=f32)  # noqa: E731
    fptr = ctypes.POINTER(ctypes.c_float)
    ptr = lambda a: a.ctypes.data_as(fptr)  # noqa: E731
    arrs = [[c(w) for w in group] for group in ws]
    lists = [(fptr * len(counts))(*[ptr(w) for w in group]) for group in arrs]
    xc, dyc = c(x), c(dy)
    cnt = np.array(counts, dtype=np.int64)
    gate_up, y, dx = np.empty((rows, 2 * f), f32), np.empty((rows, h), f32), np.empty((rows, h), f32)
    grads = [[np.empty_like(w) for w in group] for group in arrs]
    glists = [(fptr * len(counts))(*[ptr(g) for g in group]) for group in grads]
    i64 = ctypes.c_int64
    cnt_p = cnt.ctypes.data_as(ctypes.POINTER(i64))
    assert (
        lib.bmt_cpu_moe_swiglu_fwd(ptr(xc), cnt_p, i64(3), *lists, ptr(gate_up), ptr(y), i64(h), i64(f)) == 0
    )
    assert (
        lib.bmt_cpu_moe_swiglu_bwd(ptr(xc), cnt_p, i64(3), *lists, ptr(gate_up), ptr(dyc), ptr(dx), *glists,
                                   i64(h), i64(f))
        == 0
    )  # fmt: skip

    start, ref_y, ref_dx = 0, np.zeros_like(x), np.zeros_like(x)
    for e, n in enumerate(counts):
        xe, de = x[start : start + n], dy[start : start + n]
        g, u = xe @ ws[0][e], xe @ ws[1][e]
        s = 1 / (1 + np.exp(-g))
        a = g * s * u
        ref_y[start : start + n] = a @ ws[2][e]
        da = de @ ws[2][e].T
        dg, du = da * u * s * (1 + g * (1 - s)), da * g * s
        ref_dx[start : start + n] = dg @ ws[0][e].T + du @ ws[1][e].T
        for k, want in enumerate((xe.T @ dg, xe.T @ du, a.T @ de)):
            np.testing.assert_allclose(grads[k][e], want, rtol=1e-4, atol=1e-5)
        start += n
    np.testing.assert_allclose(y, ref_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
    assert not any(grads[k][1].any() for k in range(3))  # the expert without rows: zeros
