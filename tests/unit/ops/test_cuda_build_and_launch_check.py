"""CUDA architectures to build for (PADDLE_CUDA_ARCH_LIST or the detected capability, with PTX), the CUDA
launchers compiled by nvcc (every C ABI function the header declares for CUDA is exported) and ``kernels:
auto``'s one-shot launch check, exercised on CPU with our CPU kernels and a failing stand-in."""

from __future__ import annotations

import ctypes
import re

import pytest

from bmtrain_cli.ops import reference
from bmtrain_cli.ops.build import DEFAULT_CUDA_ARCHS, KernelBuildError, cuda_arch_flags, cuda_arch_list
from bmtrain_cli.ops.launch_check import fallback_line, launch_checked, run_check


def test_arch_list_from_the_variable_the_devices_or_the_default():
    assert cuda_arch_list("7.5;8.6+PTX", [(9, 0)]) == ["7.5", "8.6+PTX"]
    assert cuda_arch_list("8.0 9.0", []) == ["8.0", "9.0"]
    # a T4 and a Blackwell card: their own architectures, PTX on the newest
    assert cuda_arch_list(None, [(7, 5), (12, 0), (7, 5)]) == ["7.5", "12.0+PTX"]
    assert cuda_arch_list("", []) == list(DEFAULT_CUDA_ARCHS)
    assert any(a.endswith("+PTX") for a in DEFAULT_CUDA_ARCHS)


def test_gencode_flags_carry_ptx():
    flags = cuda_arch_flags(["8.0", "9.0+PTX"])
    assert flags == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    assert cuda_arch_flags(["12.0"]) == ["-gencode=arch=compute_120,code=sm_120"]
    with pytest.raises(KernelBuildError, match="not an architecture"):
        cuda_arch_flags(["sm_80"])


def test_launch_check_keeps_working_kernels_and_drops_failing_ones():
    ref = {n: getattr(reference, n) for n in ("rms_norm", "swiglu", "cross_entropy_sum")}

    def no_image(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device\nmore")

    def wrong(gate, up):
        return reference.swiglu(gate, up) * 2

    ours = {"rms_norm": reference.rms_norm, "swiglu": wrong, "cross_entropy_sum": no_image}
    kept, failed = launch_checked(ours, ref, run_check)
    assert list(kept) == ["rms_norm"]
    assert failed["cross_entropy_sum"].startswith("RuntimeError: CUDA error: no kernel image")
    assert "differs" in failed["swiglu"]
    line = fallback_line(failed)
    assert "\n" not in line and "swiglu" in line and "cross_entropy_sum" in line


def test_the_launch_check_leaves_the_random_stream_as_it_found_it():
    """The check seeds its own inputs (the op's and the MoE experts'), and runs while the model is built:
    the run's seeded stream (initial weights, adapters, dropout) must go on as if it had not run, passing
    or failing."""
    import numpy as np
    import paddle

    from bmtrain_cli.ops.moe_experts import launch_check_inputs, launch_check_pair

    _, experts = launch_check_pair()

    def fails(*args):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    paddle.seed(123)
    want = paddle.randn([6]).numpy()
    for ours, inputs in (
        (reference.swiglu, None),
        (experts, launch_check_inputs),
        (fails, launch_check_inputs),
    ):
        paddle.seed(123)
        name = "swiglu" if inputs is None else "moe_experts"
        ref = reference.swiglu if inputs is None else experts
        launch_checked({name: ours}, {name: ref}, lambda n, a, b, i=inputs: run_check(n, a, b, inputs=i))
        np.testing.assert_array_equal(paddle.randn([6]).numpy(), want)


def test_our_cpu_kernels_pass_the_same_check():
    from bmtrain_cli.ops import OP_NAMES, custom

    try:
        custom._ext()
    except Exception as exc:
        pytest.skip(f"custom kernels not built here: {exc}")
    ref = {n: getattr(reference, n) for n in OP_NAMES}
    kept, failed = launch_checked({n: getattr(custom, n) for n in OP_NAMES}, ref, run_check)
    assert failed == {} and set(kept) == set(OP_NAMES)


@pytest.mark.slow  # nvcc: about 10 s on 2 cores
def test_the_cuda_launchers_compile_and_export_the_header_s_functions(cuda_launchers):
    from bmtrain_cli.ops.build import CUDA_SOURCES, KERNELS_DIR

    assert "cuda/moe_cuda.cu" in CUDA_SOURCES and "cuda/fused_cuda.cu" in CUDA_SOURCES
    declared = set(re.findall(r"\b(bmt_cuda_\w+)\(", (KERNELS_DIR / "include" / "bmt_kernels.h").read_text()))
    assert {"bmt_cuda_grouped_gemm_fwd", "bmt_cuda_grouped_gemm_dx", "bmt_cuda_grouped_gemm_dw"} <= declared
    lib = ctypes.CDLL(str(cuda_launchers))
    assert [name for name in sorted(declared) if not hasattr(lib, name)] == []
