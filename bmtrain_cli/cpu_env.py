"""MKL's fast code path on AMD CPUs, set before Paddle's first matmul (``import bmtrain_cli`` does it).

Paddle's CPU wheel ships an MKL (libmklml_intel.so) that dispatches on the CPU vendor: on an AMD CPU it runs
its SSE code instead of its AVX2 code unless ``MKL_DEBUG_CPU_TYPE=5`` is set. Measured on the 2-core AMD EPYC
development machine (docs/benchmarks.md, "MKL on AMD CPUs"): a 2048^3 fp32 matmul 18 -> 45 GFLOP/s, and
the slowdown of every matmul after Paddle's CPU adam/adamw kernel (20 -> 60-98 ms) is gone (8 ms before
and after): that kernel leaves the upper YMM registers dirty, which penalises the SSE (non-VEX) code only.
MKL reads the variable at its first call, so setting it at import time, before any matmul, is enough. A
value the user set is kept; Intel CPUs and CPUs without AVX2 are left alone.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

MKL_VAR = "MKL_DEBUG_CPU_TYPE"
MKL_AVX2 = "5"


def _cpu_info(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(1 << 16)  # the first processor's block holds vendor_id and flags
    except OSError:
        return ""


def use_mkl_avx2_on_amd(
    environ: MutableMapping[str, str] = os.environ, cpuinfo: str = "/proc/cpuinfo"
) -> Optional[str]:
    """Set MKL_DEBUG_CPU_TYPE=5 on an AMD CPU with AVX2 unless it is set already; returns the value set,
    or None when nothing was changed."""
    if MKL_VAR in environ:
        return None
    info = _cpu_info(cpuinfo)
    vendor = next((line for line in info.splitlines() if line.startswith("vendor_id")), "")
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    if "AuthenticAMD" not in vendor or " avx2" not in flags:
        return None
    environ[MKL_VAR] = MKL_AVX2
    return MKL_AVX2
