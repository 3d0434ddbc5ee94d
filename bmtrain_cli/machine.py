"""Cheap facts about the installed Paddle and the build tools, without importing Paddle (validate-config stays fast)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
from typing import Optional

# the size of the CPU's matmul throughput probe (MFU's "peak": train/monitoring/metrics.measured_matmul_flops);
# the memory plan counts its matrices, which it holds beside the weights before the first step
MATMUL_PROBE_N = 1536


def paddle_distribution() -> Optional[str]:
    """Name of the installed Paddle distribution (paddlepaddle, paddlepaddle-gpu, ...) or None."""
    for name in ("paddlepaddle-gpu", "paddlepaddle", "paddlepaddle-xpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return "paddle (unknown build)" if importlib.util.find_spec("paddle") else None


def gpu_available() -> bool:
    """The one has-a-GPU check: Paddle is built with CUDA and sees at least one GPU (imports Paddle)."""
    import paddle

    try:
        return bool(paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0)
    except (RuntimeError, ValueError):
        return False


def paddle_has_gpu(import_paddle: bool = False) -> bool:
    """True when the installed Paddle can use a CUDA GPU: the GPU build is installed (without importing
    Paddle), or with import_paddle, :func:`gpu_available`."""
    if import_paddle:
        return gpu_available()
    return paddle_distribution() == "paddlepaddle-gpu"


def find_cxx() -> Optional[str]:
    """The C++ compiler the CPU custom kernels are built with ($CXX or c++, else g++), or None."""
    return shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")
