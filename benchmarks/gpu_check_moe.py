"""The MoE experts' grouped GEMM launchers (kernels/cuda/moe_cuda.cu) on an NVIDIA GPU, for gpu_check.py.

Each case runs the three launchers (fwd y_e = x_e op(w_e), dx, dw) over rows sorted by expert on device
buffers owned by PyTorch or CuPy, and compares them with a float64 NumPy reference of the same (rounded)
inputs, expert by expert: odd sizes, experts without rows (their weight gradient must be overwritten with
zeros), one expert taking every row, no rows at all, both weight layouts, one expert with more row tiles
than a CUDA grid has rows. The Qwen3-MoE-shaped case (64 experts, 4096 routed rows, hidden 1024, expert
ffn 256) is timed against the same products written as a framework loop over the experts, and its
throughput reported in TFLOP/s.
"""

from __future__ import annotations

import ctypes
from typing import Dict, List, Sequence

import numpy as np

CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # max abs error / max(1, max |ref|)


def bind(lib: ctypes.CDLL) -> None:
    i64, p, i = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.bmt_cuda_grouped_gemm_workspace.argtypes = [i64]
    lib.bmt_cuda_grouped_gemm_workspace.restype = i64
    for name in (
        "fwd",
        "dx",
        "dw",
    ):  # (dtype, three pointers, counts, experts, k, n, trans_w, workspace, stream)
        fn = getattr(lib, f"bmt_cuda_grouped_gemm_{name}")
        fn.argtypes, fn.restype = [i, p, p, p, p, i64, i64, i64, i, p, p], i


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max(initial=0.0)) / max(1.0, float(np.abs(want).max(initial=0.0)))


def _reference(x, dy, ws, counts, trans_w):
    """(y, dx, [dw_e]) in float64, expert by expert."""
    y = np.zeros((x.shape[0], ws[0].shape[0] if trans_w else ws[0].shape[1]))
    dx, dws, start = np.zeros_like(x), [], 0
    for w, m in zip(ws, counts):
        xe, de = x[start : start + m], dy[start : start + m]
        wk = w.T if trans_w else w  # [k, n]
        y[start : start + m] = xe @ wk
        dx[start : start + m] = de @ wk.T
        dws.append(de.T @ xe if trans_w else xe.T @ de)
        start += m
    return y, dx, dws


def check_grouped(
    be, lib, dtype: str, counts: Sequence[int], k: int, n: int, trans_w: int, rng, timing: bool
):
    """Errors of y, dx and dw (and, when timing, ours against a framework loop over the experts)."""
    import time

    rows, e = int(sum(counts)), len(counts)
    shape = (n, k) if trans_w else (k, n)
    x, dy = be.put(rng.standard_normal((rows, k)), dtype), be.put(rng.standard_normal((rows, n)), dtype)
    ws = [be.put(rng.standard_normal(shape) / np.sqrt(k), dtype) for _ in counts]
    y, dx = be.empty((rows, n), dtype), be.empty((rows, k), dtype)
    dws = [be.put(np.full(shape, 7.0), dtype) for _ in counts]  # must be overwritten, zeros included
    cnt = np.asarray(counts, dtype=np.int64)
    cptr = cnt.ctypes.data_as(ctypes.c_void_p)
    wlist = (ctypes.c_void_p * e)(*[be.ptr(w) for w in ws])
    dwlist = (ctypes.c_void_p * e)(*[be.ptr(w) for w in dws])
    space = be.empty_bytes(lib.bmt_cuda_grouped_gemm_workspace(e))
    code, s = CODES[dtype], be.stream()
    calls = {
        "fwd": lambda: lib.bmt_cuda_grouped_gemm_fwd(code, be.ptr(x), wlist, be.ptr(y), cptr, e, k, n, trans_w, be.ptr(space), s),
        "dx": lambda: lib.bmt_cuda_grouped_gemm_dx(code, be.ptr(dy), wlist, be.ptr(dx), cptr, e, k, n, trans_w, be.ptr(space), s),
        "dw": lambda: lib.bmt_cuda_grouped_gemm_dw(code, be.ptr(x), be.ptr(dy), dwlist, cptr, e, k, n, trans_w, be.ptr(space), s),
    }  # fmt: skip
    for name, call in calls.items():
        status = call()
        if status != 0:
            raise RuntimeError(f"grouped_gemm {name}: launcher status {status}")
    be.sync()
    ry, rdx, rdws = _reference(be.host(x), be.host(dy), [be.host(w) for w in ws], counts, trans_w)
    out = {"y": _err(be.host(y), ry), "dx": _err(be.host(dx), rdx)}
    out["dw"] = max(_err(be.host(got), want) for got, want in zip(dws, rdws))
    if timing:

        def clock(fn) -> float:
            fn()
            be.sync()
            t0 = time.perf_counter()
            for _ in range(10):
                fn()
            be.sync()
            return (time.perf_counter() - t0) / 10 * 1e3

        out["ours_ms"] = clock(lambda: [c() for c in calls.values()])
        out["framework_loop_ms"] = clock(lambda: _framework_loop(x, dy, ws, counts, trans_w))
        out["TFLOPs"] = 3 * 2 * rows * k * n / (out["ours_ms"] * 1e-3) / 1e12
    return out


def _framework_loop(x, dy, ws, counts: Sequence[int], trans_w: int) -> None:
    """The same three products as a loop over the experts with the framework's matmuls (PyTorch or CuPy)."""
    start = 0
    for w, m in zip(ws, counts):
        xe, de = x[start : start + m], dy[start : start + m]
        wk = w.T if trans_w else w
        _ = (xe @ wk, de @ wk.T, (de.T @ xe) if trans_w else (xe.T @ de))
        start += m


def cases(rng) -> Dict[str, tuple]:
    """name -> (counts, k, n, trans_w, timed)."""
    routed = np.bincount(rng.integers(0, 64, size=4096), minlength=64).tolist()  # 512 tokens x top 8
    return {
        "odd sizes, empty experts": ([7, 0, 130, 1, 0], 33, 17, 0, False),
        "odd sizes, [out, in] weights": ([7, 0, 130, 1, 0], 33, 17, 1, False),
        "one expert takes every row": ([0, 0, 200, 0], 64, 80, 0, False),
        "one row": ([1], 5, 3, 0, False),
        "no rows at all": ([0, 0, 0], 16, 8, 0, False),
        "tall: 3000 rows of one expert": ([3000, 5], 40, 24, 1, False),
        # more row tiles than a grid has rows (65535): the kernel's blocks loop over row tiles
        "past the grid: 65535 x 64 + 1 rows of one expert": ([65535 * 64 + 1, 3], 8, 4, 0, False),
        "qwen3-moe gate/up 64 x [1024, 256]": (routed, 1024, 256, 0, True),
        "qwen3-moe down 64 x [256, 1024]": (routed, 256, 1024, 0, True),
    }


def run(be, lib, dtypes: List[str], rng) -> List[str]:
    """Every case for every dtype, one printed line each; the failures."""
    bind(lib)
    failures: List[str] = []
    for dtype in dtypes:
        for name, (counts, k, n, trans_w, timed) in cases(rng).items():
            key = f"grouped_gemm {name} {dtype}"
            res = check_grouped(be, lib, dtype, counts, k, n, trans_w, rng, timed)
            errs = {k_: v for k_, v in res.items() if k_ in ("y", "dx", "dw")}
            # an fp32 sum of m products rounds by about eps sqrt(m) of its size: the weight gradient of an
            # expert with millions of rows gets a proportionally wider tolerance
            tol = TOL[dtype] * max(1.0, float(np.sqrt(max(counts) / 65536)))
            bad = [k_ for k_, v in errs.items() if not v <= tol]
            if bad:
                failures.append(f"{key}: {bad}")
            speed = "".join(f"  {k_} {v:.3f}" for k_, v in res.items() if k_ not in errs)
            print(
                f"{key:60s} max rel err {max(errs.values()):.2e} {'OK' if not bad else 'FAIL'}{speed}",
                flush=True,
            )
    return failures
