"""The MoE experts on a GPU (ops/moe_experts.py over kernels/cuda/moe_cuda.cu): which implementation each
mode and device gets, the launch check that guards our CUDA grouped GEMM and the one warning when it fails,
the Paddle operators' refusals on a CPU, and the launcher's C ABI on the host (built with nvcc alone:
workspace size, dtype and shape errors, no launch for empty work). The products are checked here through a host
emulation of the kernel (the CUDA source run on the CPU, one std::thread per GPU thread); on a GPU,
``test_cuda_grouped_experts_equal_the_reference`` runs with a GPU build of Paddle, and
``python benchmarks/gpu_check.py`` checks the launchers forward and backward on any NVIDIA GPU."""

from __future__ import annotations

import ctypes
import importlib.util
import warnings
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.errors import NoticeWarning
from bmtrain_cli.ops import moe_experts
from bmtrain_cli.ops.launch_check import run_check
from bmtrain_cli.ops.moe_experts import (
    choose,
    cuda_grouped_experts,
    for_device,
    grouped_experts,
    launch_check_inputs,
    launch_check_pair,
    reference_experts,
    resolve,
    swiglu_expert,
)


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch):
    """No launch check, reason or warning carried over from another test."""
    for name in ("_told", "_checked"):
        monkeypatch.setattr(moe_experts, name, type(getattr(moe_experts, name))())
    monkeypatch.setattr(moe_experts, "_why", {})


def test_each_mode_and_device_gets_its_implementation():
    assert choose("auto", "gpu:0", True)[0] == "grouped_cuda"
    assert choose("custom", "gpu:1", True)[0] == "grouped_cuda"
    for mode, built in (("auto", False), ("paddle", True), ("reference", True)):
        assert choose(mode, "gpu:0", built)[0] == "reference"
    assert "fused_moe" in choose("paddle", "gpu:0", True)[1]  # why Paddle's own op is not used
    assert choose("auto", "cpu", True)[0] == "grouped"  # the CPU is unchanged


def test_a_gpu_takes_our_grouped_gemm_once_it_passes_its_launch_check():
    calls = []

    def passes(name, ours, ref):
        calls.append(name)
        return None

    assert for_device("auto", "gpu:0", True, passes) is cuda_grouped_experts
    assert for_device("custom", "gpu:0", True, passes) is cuda_grouped_experts
    assert calls == ["moe_experts"]  # checked once per device
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(cuda_grouped_experts, "auto", "gpu:0") is cuda_grouped_experts
    assert for_device("auto", "cpu", True) is grouped_experts
    assert for_device("paddle", "gpu:0", True, passes) is None and calls == ["moe_experts"]


def test_a_failed_launch_check_falls_back_with_one_warning_naming_why():
    def no_image(name, ours, ref):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\ndetails")

    assert for_device("auto", "gpu:0", True, no_image) is None
    with pytest.warns(NoticeWarning) as rec:
        assert resolve(None, "auto", "gpu:0") is None
    (line,) = [str(r.message) for r in rec]
    assert "launch check on gpu:0" in line and "no kernel image" in line and "\n" not in line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(None, "auto", "gpu:0") is None  # once per process and reason


def test_the_real_launch_check_rejects_what_does_not_run_here():
    """The default check (ops/launch_check.run_check over launch_check_pair) on this CPU-only machine: our
    CUDA path refuses CPU tensors, so the check fails with that reason and the experts fall back."""
    assert for_device("auto", "gpu:0", True) is None
    assert (
        "ValueError: moe experts: the CUDA grouped GEMM takes one dtype of float32/float16/bfloat16 on a GPU"
        in moe_experts._why[("auto", "gpu:0")]
    )


def test_the_launch_check_compares_outputs_and_every_gradient():
    _, ref = launch_check_pair()
    assert run_check("moe_experts", ref, ref, inputs=launch_check_inputs) is None

    def wrong_down_grad(x, *w):  # the same output, the down projections' gradients doubled
        e = len(moe_experts.CHECK_COUNTS)
        down = [d + (d - d.detach()) for d in w[2 * e :]]
        return ref(x, *w[: 2 * e], *down)

    assert "differs" in run_check("moe_experts", wrong_down_grad, ref, inputs=launch_check_inputs)
    x, *weights = launch_check_inputs()
    assert x.shape == [sum(moe_experts.CHECK_COUNTS), 8] and len(weights) == 9


def test_the_operators_refuse_cpu_tensors(ext):
    x, w = paddle.randn([5, 8]), [paddle.randn([8, 4]) for _ in range(3)]
    for call in (
        lambda: ext.bmt_grouped_gemm(x, w, [3, 0, 2], False),
        lambda: ext.bmt_grouped_gemm_dx(paddle.randn([5, 4]), w, [3, 0, 2], False),
        lambda: ext.bmt_grouped_gemm_dw(x, paddle.randn([5, 4]), w, [3, 0, 2], False),
    ):
        with pytest.raises(Exception, match="GPU only"):
            call()
    with pytest.raises(ValueError, match="on a GPU"):
        cuda_grouped_experts(x, [3, 0, 2], (w, w, [paddle.randn([4, 8]) for _ in range(3)]))


@pytest.fixture(scope="module")
def cuda_lib(cuda_launchers):
    return _bound(ctypes.CDLL(str(cuda_launchers)))


def _bound(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The launchers' C signatures as the GPU check (benchmarks/gpu_check_moe.py) binds them."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check_moe.py"
    spec = importlib.util.spec_from_file_location("gpu_check_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.bind(lib)
    return lib


def _counts(values):
    arr = np.array(values, dtype=np.int64)
    return arr, arr.ctypes.data_as(ctypes.c_void_p)


@pytest.mark.slow  # nvcc: about 10 s on 2 cores
def test_the_launcher_checks_its_arguments_on_the_host(cuda_lib):
    """Errors found before any CUDA call, so they hold on a machine without a GPU: the dtype, a negative
    count, empty sizes; and work without rows returns at once (nothing to launch)."""
    import re

    from bmtrain_cli.ops.build import KERNELS_DIR

    header = (KERNELS_DIR / "include" / "bmt_kernels.h").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"(BMT_ERR_\w+) = (\d+)", header)}
    assert cuda_lib.bmt_cuda_grouped_gemm_workspace(3) == 7 * 8  # 4 offsets and 3 pointers
    fwd, dx, dw = (getattr(cuda_lib, f"bmt_cuda_grouped_gemm_{n}") for n in ("fwd", "dx", "dw"))
    _keep, ok = _counts([3, 0, 2])
    _keep2, negative = _counts([3, -1, 2])
    _keep3, empty = _counts([0, 0, 0])
    f64 = 3
    assert fwd(f64, None, None, None, ok, 3, 8, 4, 0, None, None) == codes["BMT_ERR_DTYPE"]
    assert dw(f64, None, None, None, ok, 3, 8, 4, 0, None, None) == codes["BMT_ERR_DTYPE"]
    for fn in (fwd, dx, dw):
        assert fn(0, None, None, None, negative, 3, 8, 4, 0, None, None) == codes["BMT_ERR_SHAPE"]
        assert fn(1, None, None, None, ok, 3, 0, 4, 1, None, None) == codes["BMT_ERR_SHAPE"]
        assert fn(2, None, None, None, ok, 0, 8, 4, 0, None, None) == codes["BMT_ERR_SHAPE"]
    for fn in (fwd, dx):  # no rows at all: no output element, nothing launched
        assert fn(0, None, None, None, empty, 3, 8, 4, 0, None, None) == 0


GRID_Y_MAX = 2  # the emulated build's limit on the grid's rows


@pytest.fixture(scope="module")
def emulated_lib(tmp_path_factory):
    """kernels/cuda/moe_cuda.cu built for the CPU with the host emulation of tests/unit/ops/cuda_emu (each
    block's threads as std::threads meeting at a barrier for __syncthreads): its kernel and host code run
    as written, only the launch line rewritten into the emulator's call."""
    import re
    import subprocess
    from pathlib import Path

    from bmtrain_cli.machine import find_cxx
    from bmtrain_cli.ops.build import KERNELS_DIR

    cxx = find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = (KERNELS_DIR / "cuda" / "moe_cuda.cu").read_text()
    launch = r"(\w+<T>)<<<([^,]+), (dim3\([^)]*\)), 0, st>>>\(([^;]*)\);"
    emulated, n = re.subn(launch, r"bmt_emu::launch(\2, \3, [&] { \1(\4); });", src)
    assert n == 1, "the kernel launch line of moe_cuda.cu changed: update the rewrite above"
    out = tmp_path_factory.mktemp("emu")
    (out / "moe_emu.cc").write_text(emulated)
    emu = Path(__file__).resolve().parent / "cuda_emu"
    include = [f"-I{emu}", f"-I{KERNELS_DIR / 'include'}", f"-I{KERNELS_DIR / 'cuda'}"]
    # a grid of at most 2 rows (CUDA: 65535), so the cases below with 3 row tiles take the kernel's loop
    # over row tiles that a GPU takes past 65535 x 64 rows per expert
    limit = f"-DBMT_GRID_Y_MAX={GRID_Y_MAX}"
    cmd = [cxx, "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", limit, *include, str(out / "moe_emu.cc")]
    subprocess.run([*cmd, "-o", str(out / "libemu.so")], check=True, capture_output=True)
    return _bound(ctypes.CDLL(str(out / "libemu.so")))


@pytest.mark.parametrize(
    "counts,k,n,trans_w,dtype",
    [
        ([7, 0, 130, 1, 0], 33, 17, 0, 0),  # odd sizes, experts without rows, several row tiles
        ([7, 0, 130, 1, 0], 33, 17, 1, 0),  # weights [out, in]
        ([0, 0, 70, 0], 64, 80, 0, 2),  # one expert takes every row; the bf16 dispatch
        ([1], 5, 3, 1, 1),  # one row; the fp16 dispatch
        ([3, 2], 70, 65, 0, 0),  # several tiles of the weight gradient in both dimensions
        ([5, 0, 3], 150, 9, 0, 0),  # more row tiles of the weight gradient than the grid has rows
    ],
)
def test_the_kernel_emulated_on_the_host_equals_numpy(emulated_lib, counts, k, n, trans_w, dtype):
    """fwd, dx and dw of every expert against numpy; the weight gradients of experts without rows are
    overwritten with zeros, the outputs fully written. (fp16/bf16 are held as floats by the emulation: those
    cases check the dispatch, not the rounding.)"""
    rng = np.random.default_rng(0)
    e, rows = len(counts), sum(counts)
    shape = (n, k) if trans_w else (k, n)
    x, dy = (rng.standard_normal(s).astype(np.float32) for s in ((rows, k), (rows, n)))
    ws = [rng.standard_normal(shape).astype(np.float32) for _ in counts]
    y, dx = np.full((rows, n), 9, np.float32), np.full((rows, k), 9, np.float32)
    dws = [np.full(shape, 7, np.float32) for _ in counts]
    cnt = np.array(counts, np.int64)
    space = np.zeros(emulated_lib.bmt_cuda_grouped_gemm_workspace(e), np.uint8)
    ptr = ctypes.c_void_p
    wl, dwl = ((ptr * e)(*[a.ctypes.data for a in arrays]) for arrays in (ws, dws))
    p = lambda a: a.ctypes.data_as(ptr)  # noqa: E731
    args = (p(cnt), e, k, n, trans_w, p(space), None)
    assert emulated_lib.bmt_cuda_grouped_gemm_fwd(dtype, p(x), wl, p(y), *args) == 0
    assert emulated_lib.bmt_cuda_grouped_gemm_dx(dtype, p(dy), wl, p(dx), *args) == 0
    assert emulated_lib.bmt_cuda_grouped_gemm_dw(dtype, p(x), p(dy), dwl, *args) == 0
    start = 0
    for w, m, got in zip(ws, counts, dws):
        xe, de, wk = x[start : start + m], dy[start : start + m], w.T if trans_w else w
        np.testing.assert_allclose(y[start : start + m], xe @ wk, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(dx[start : start + m], de @ wk.T, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got, de.T @ xe if trans_w else xe.T @ de, rtol=1e-4, atol=1e-4)
        start += m


@pytest.mark.skipif(not paddle.is_compiled_with_cuda(), reason="needs a GPU build of Paddle")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_grouped_experts_equal_the_reference(ext, dtype):
    """On a GPU: output, input and every weight gradient against the per-expert composition, odd sizes and
    experts without rows."""
    counts, h, f = [7, 0, 130, 1, 0], 33, 17
    rng = np.random.default_rng(0)
    shapes = [(sum(counts), h)] + [s for s in ((h, f), (h, f), (f, h)) for _ in counts]
    values = [rng.standard_normal(s) / np.sqrt(s[0]) for s in shapes]
    e = len(counts)

    results = []
    for fn in (cuda_grouped_experts, None):
        x, *w = [paddle.to_tensor(v).astype(dtype) for v in values]
        for t in (x, *w):
            t.stop_gradient = False
        gate, up, down = w[:e], w[e : 2 * e], w[2 * e :]
        if fn is None:
            y = reference_experts(x, counts, [swiglu_expert(*w) for w in zip(gate, up, down)])
        else:
            y = fn(x, counts, (gate, up, down))
        y.astype("float32").square().sum().backward()
        results.append(
            [t.astype("float32").numpy() for t in [y, x.grad, *(w.grad for w in gate + up + down)]]
        )
    tol = 1e-4 if dtype == "float32" else 3e-2
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_each_grouped_implementation_says_which_dtypes_it_takes():
    """The model asks the implementation (models/moe.py): bf16 rows reach the CUDA GEMM, not the CPU one."""
    import paddle

    from bmtrain_cli.ops.moe_experts import cuda_grouped_experts, grouped_experts, takes

    assert takes(grouped_experts, paddle.float32) and not takes(grouped_experts, paddle.bfloat16)
    for dtype in (paddle.float32, paddle.float16, paddle.bfloat16):
        assert takes(cuda_grouped_experts, dtype)
    assert not takes(cuda_grouped_experts, paddle.float64)
