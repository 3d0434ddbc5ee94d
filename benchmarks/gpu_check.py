"""Check the CUDA launchers on an NVIDIA GPU without a GPU build of Paddle: nvcc + PyTorch or CuPy.

Builds kernels/cuda/*.cu with nvcc into a shared library, calls the C ABI launchers through ctypes on
device buffers owned by PyTorch (preferred) or CuPy, checks every kernel (forward and backward) against a
float64 NumPy reference of the same (rounded) inputs for fp32, fp16 and bf16 (bf16 needs PyTorch; the
softmax cross-entropy launcher is fp32 by design: its logits are fp32) and the MoE experts' grouped GEMM
(gpu_check_moe.py: forward, input and weight gradients over odd shapes and experts without rows), times
each launcher against the same computation written as composite framework ops on the GPU (the grouped
GEMM against a loop over the experts, in TFLOP/s), and reports the achieved memory bandwidth of our
forward + backward (the bytes each launcher must read and write, over its time) as a fraction of the
device's peak (from the memory clock and bus width the driver reports, else a table of known devices).

It imports neither Paddle nor bmtrain_cli. Run on the GPU machine:
    python benchmarks/gpu_check.py            # build, check, time; exit 1 on a mismatch
    python benchmarks/gpu_check.py --compile-only   # just the nvcc build (works without a GPU)
Record the printed figures in docs/benchmarks.md ("Kernels on GPU").
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels"
CU_SOURCES = [KERNELS / "cuda" / "fused_cuda.cu", KERNELS / "cuda" / "moe_cuda.cu"]
ARCHS = [
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",  # PTX: newer GPUs compile it at the first launch
]
F32, F16, BF16 = 0, 1, 2
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # max abs error / max(1, max |ref|)


def find_nvcc() -> Optional[str]:
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.access(os.path.join(base, "bin", "nvcc"), os.X_OK):
            return os.path.join(base, "bin", "nvcc")
    return None


def build_library(out_dir: Path) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    lib = out_dir / "libbmt_cuda.so"
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", f"-I{KERNELS / 'include'}", *ARCHS]
    cmd += [str(s) for s in CU_SOURCES] + ["-o", str(lib)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    print(f"nvcc build: {time.perf_counter() - t0:.1f} s -> {lib}")
    return lib


def bind(lib: ctypes.CDLL) -> None:
    i64, p, i = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    sigs = {
        "bmt_cuda_rms_norm_fwd": [i, p, p, p, p, i64, i64, ctypes.c_float, p],
        "bmt_cuda_rms_norm_bwd_workspace": [i64, i64],
        "bmt_cuda_rms_norm_bwd": [i, p, p, p, p, p, p, p, i64, i64, p],
        "bmt_cuda_rotary": [i, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i, p],
        "bmt_cuda_swiglu_fwd": [i, p, p, p, i64, p],
        "bmt_cuda_swiglu_bwd": [i, p, p, p, p, p, i64, p],
        "bmt_cuda_softmax_xent": [i, p, p, p, p, i64, i64, i64, p, p],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = i64 if name.endswith("workspace") else i


# ---------------------------------------------------------------- device array backends
class TorchBackend:
    name = "torch"

    def __init__(self):
        import torch

        self.t = torch
        self.dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        self.device = torch.device("cuda")

    def put(self, a: np.ndarray, dtype: str):
        t = self.t
        if a.dtype == np.int64:
            return t.from_numpy(a).to(self.device)
        return t.from_numpy(a.astype(np.float32)).to(self.device).to(self.dt[dtype])

    def host(self, x) -> np.ndarray:
        return x.float().cpu().numpy().astype(np.float64) if x.is_floating_point() else x.cpu().numpy()

    def empty(self, shape, dtype: str):
        return self.t.empty(shape, dtype=self.dt[dtype], device=self.device)

    def empty_bytes(self, n: int):
        return self.t.empty(max(n, 1), dtype=self.t.uint8, device=self.device)

    def ptr(self, x) -> int:
        return x.data_ptr()

    def stream(self) -> int:
        return self.t.cuda.current_stream().cuda_stream

    def sync(self) -> None:
        self.t.cuda.synchronize()

    def device_name(self) -> str:
        return self.t.cuda.get_device_name()

    # composite versions (what an unfused framework runs), for timing
    def ref_rms(self, x, w, eps):
        xf = x.float()
        return (xf * self.t.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def ref_swiglu(self, g, u):
        return self.t.nn.functional.silu(g) * u

    def ref_rotary(self, q, c, s):
        half = q.shape[-1] // 2
        rot = self.t.cat([-q[..., half:], q[..., :half]], dim=-1)
        return q * c + rot * s

    def ref_xent(self, logits, labels):
        return self.t.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


class CupyBackend:
    name = "cupy"

    def __init__(self):
        import cupy

        self.cp = cupy
        self.dt = {"float32": cupy.float32, "float16": cupy.float16}

    def put(self, a: np.ndarray, dtype: str):
        if a.dtype == np.int64:
            return self.cp.asarray(a)
        return self.cp.asarray(a.astype(np.float32)).astype(self.dt[dtype])

    def host(self, x) -> np.ndarray:
        a = self.cp.asnumpy(x)
        return a.astype(np.float64) if a.dtype.kind == "f" else a

    def empty(self, shape, dtype: str):
        return self.cp.empty(shape, dtype=self.dt[dtype])

    def empty_bytes(self, n: int):
        return self.cp.empty(max(n, 1), dtype=self.cp.uint8)

    def ptr(self, x) -> int:
        return x.data.ptr

    def stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def device_name(self) -> str:
        return self.cp.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def ref_rms(self, x, w, eps):
        xf = x.astype(self.cp.float32)
        return (xf / self.cp.sqrt((xf * xf).mean(axis=-1, keepdims=True) + eps)).astype(x.dtype) * w

    def ref_swiglu(self, g, u):
        return g / (1 + self.cp.exp(-g)) * u

    def ref_rotary(self, q, c, s):
        half = q.shape[-1] // 2
        rot = self.cp.concatenate([-q[..., half:], q[..., :half]], axis=-1)
        return q * c + rot * s

    def ref_xent(self, logits, labels):
        m = logits.max(axis=-1, keepdims=True)
        lse = self.cp.log(self.cp.exp(logits - m).sum(axis=-1)) + m[:, 0]
        valid = labels != -100
        safe = self.cp.where(valid, labels, 0)
        picked = self.cp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
        return ((lse - picked) * valid).sum()


def pick_backend():
    try:
        import torch

        if torch.cuda.is_available():
            return TorchBackend()
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return CupyBackend()
    except Exception:  # cupy missing or no driver
        pass
    raise SystemExit("no NVIDIA GPU reachable through PyTorch or CuPy")


# ---------------------------------------------------------------- checks
# Peak HBM bandwidth (bytes/s) of common devices, used when the driver's clock/bus figures are unavailable.
PEAK_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 SXM": 3.35e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "RTX 4090": 1.008e12,
}


def peak_bandwidth(be) -> Optional[float]:
    """Bytes/s: 2 (double data rate) x memory clock x bus width, as the driver reports them, else the table."""
    clock_khz = bus_bits = None
    if be.name == "cupy":
        props = be.cp.cuda.runtime.getDeviceProperties(0)
        clock_khz, bus_bits = props.get("memoryClockRate"), props.get("memoryBusWidth")
    else:
        props = be.t.cuda.get_device_properties(0)
        clock_khz = getattr(props, "memory_clock_rate", None)
        bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8
    name = be.device_name()
    for key, value in PEAK_BANDWIDTH.items():  # most specific names first
        if key in name:
            return value
    return None


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max(initial=0.0)) / max(1.0, float(np.abs(want).max(initial=0.0)))


def _time(be, fn: Callable[[], object], reps: int = 20) -> float:
    fn()
    be.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    be.sync()
    return (time.perf_counter() - t0) / reps * 1e3


def _ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: launcher status {status}")


def check_rms(be, lib, dtype: str, rows: int, cols: int, rng, timing: bool) -> Dict[str, float]:
    code = {"float32": F32, "float16": F16, "bfloat16": BF16}[dtype]
    x, w, dy = (
        be.put(rng.standard_normal((rows, cols)), dtype),
        be.put(rng.standard_normal(cols), dtype),
        None,
    )
    dy = be.put(rng.standard_normal((rows, cols)), dtype)
    y, rstd = be.empty((rows, cols), dtype), be.empty((rows,), "float32")
    dx, dw = be.empty((rows, cols), dtype), be.empty((cols,), dtype)
    ws = be.empty_bytes(lib.bmt_cuda_rms_norm_bwd_workspace(rows, cols))
    s = be.stream()

    def fwd():
        return lib.bmt_cuda_rms_norm_fwd(
            code, be.ptr(x), be.ptr(w), be.ptr(y), be.ptr(rstd), rows, cols, 1e-6, s
        )

    def bwd():
        return lib.bmt_cuda_rms_norm_bwd(
            code,
            be.ptr(dy),
            be.ptr(x),
            be.ptr(w),
            be.ptr(rstd),
            be.ptr(dx),
            be.ptr(dw),
            be.ptr(ws),
            rows,
            cols,
            s,
        )

    _ok(fwd(), "rms_norm fwd")
    _ok(bwd(), "rms_norm bwd")
    be.sync()
    X, W, DY = be.host(x), be.host(w), be.host(dy)
    r = 1 / np.sqrt((X * X).mean(-1, keepdims=True) + 1e-6)
    xhat = X * r
    DX = r * (DY * W - xhat * (DY * W * xhat).mean(-1, keepdims=True))
    out = {
        "y": _err(be.host(y), xhat * W),
        "dx": _err(be.host(dx), DX),
        "dw": _err(be.host(dw), (DY * xhat).sum(0)),
    }
    if timing:
        out["ours_ms"] = _time(be, lambda: (fwd(), bwd()))
        out["framework_fwd_ms"] = _time(be, lambda: be.ref_rms(x, w, 1e-6))
        e = ELEMENT_BYTES[dtype]  # fwd: x in, y out, rstd; bwd: dy and x in, dx out, rstd and w
        out["bytes"] = 5 * rows * cols * e + 2 * rows * 4 + 3 * cols * e
    return out


def check_swiglu(be, lib, dtype: str, n: int, rng, timing: bool, offset: int = 0) -> Dict[str, float]:
    """``offset`` > 0 starts gate/up/grad that many elements into their buffers (unaligned: the scalar path)."""
    code = {"float32": F32, "float16": F16, "bfloat16": BF16}[dtype]
    g, u, d = (be.put(rng.standard_normal(n + offset) * 4, dtype)[offset:],
               be.put(rng.standard_normal(n + offset), dtype)[offset:],
               be.put(rng.standard_normal(n + offset), dtype)[offset:])  # fmt: skip
    out, dg, du = be.empty((n,), dtype), be.empty((n,), dtype), be.empty((n,), dtype)
    s = be.stream()
    fwd = lambda: lib.bmt_cuda_swiglu_fwd(code, be.ptr(g), be.ptr(u), be.ptr(out), n, s)  # noqa: E731
    bwd = lambda: lib.bmt_cuda_swiglu_bwd(code, be.ptr(g), be.ptr(u), be.ptr(d), be.ptr(dg), be.ptr(du), n, s)  # noqa: E731
    _ok(fwd(), "swiglu fwd")
    _ok(bwd(), "swiglu bwd")
    be.sync()
    G, U, D = be.host(g), be.host(u), be.host(d)
    sg = 1 / (1 + np.exp(-G))
    res = {
        "out": _err(be.host(out), G * sg * U),
        "dgate": _err(be.host(dg), D * U * (sg + G * sg * (1 - sg))),
        "dup": _err(be.host(du), D * G * sg),
    }
    if timing:
        res["ours_ms"] = _time(be, lambda: (fwd(), bwd()))
        res["framework_fwd_ms"] = _time(be, lambda: be.ref_swiglu(g, u))
        res["bytes"] = 8 * n * ELEMENT_BYTES[dtype]  # fwd: gate, up in, out; bwd: gate, up, grad in, 2 out
    return res


def check_rotary(be, lib, dtype: str, b: int, s_: int, qh: int, kh: int, d: int, rng, timing: bool):
    code = {"float32": F32, "float16": F16, "bfloat16": BF16}[dtype]
    q, k = (
        be.put(rng.standard_normal((b, s_, qh, d)), dtype),
        be.put(rng.standard_normal((b, s_, kh, d)), dtype),
    )
    ang = rng.standard_normal((b, s_, d)) * 3
    c, sn = be.put(np.cos(ang), dtype), be.put(np.sin(ang), dtype)
    qo, ko = be.empty((b, s_, qh, d), dtype), be.empty((b, s_, kh, d), dtype)
    dq, dk = be.empty((b, s_, qh, d), dtype), be.empty((b, s_, kh, d), dtype)
    st = be.stream()

    def launch(src_q, src_k, dst_q, dst_k, backward):
        return lib.bmt_cuda_rotary(
            code, be.ptr(src_q), be.ptr(src_k), be.ptr(c), be.ptr(sn), be.ptr(dst_q), be.ptr(dst_k),
            b, s_, qh, kh, d, b, backward, st,
        )  # fmt: skip

    _ok(launch(q, k, qo, ko, 0), "rotary fwd")
    _ok(launch(q, k, dq, dk, 1), "rotary bwd")  # the gradient of an upstream grad equal to q, k
    be.sync()
    Q, K, C, S = be.host(q), be.host(k), be.host(c)[:, :, None], be.host(sn)[:, :, None]
    half = d // 2

    def rot(a):
        return np.concatenate([-a[..., half:], a[..., :half]], axis=-1)

    def rot_t(a):  # transpose of rot
        return np.concatenate([a[..., half:], -a[..., :half]], axis=-1)

    res = {
        "q": _err(be.host(qo), Q * C + rot(Q) * S),
        "k": _err(be.host(ko), K * C + rot(K) * S),
        "dq": _err(be.host(dq), Q * C + rot_t(Q * S)),
        "dk": _err(be.host(dk), K * C + rot_t(K * S)),
    }
    if timing:
        res["ours_ms"] = _time(be, lambda: (launch(q, k, qo, ko, 0), launch(q, k, dq, dk, 1)))
        cc = c.reshape(b, s_, 1, d) if be.name == "torch" else c[:, :, None]
        ss = sn.reshape(b, s_, 1, d) if be.name == "torch" else sn[:, :, None]
        res["framework_fwd_ms"] = _time(be, lambda: (be.ref_rotary(q, cc, ss), be.ref_rotary(k, cc, ss)))
        # each of fwd and bwd reads q, k, cos, sin and writes q, k
        res["bytes"] = 2 * (2 * b * s_ * (qh + kh) * d + 2 * b * s_ * d) * ELEMENT_BYTES[dtype]
    return res


def check_xent(be, lib, rows: int, vocab: int, rng, timing: bool) -> Dict[str, float]:
    logits = be.put(rng.standard_normal((rows, vocab)) * 3, "float32")
    lab = rng.integers(0, vocab, rows)
    lab[::5] = -100
    labels = be.put(lab.astype(np.int64), "float32")
    loss, dl = be.empty((rows,), "float32"), be.empty((rows, vocab), "float32")
    s = be.stream()

    def run():
        return lib.bmt_cuda_softmax_xent(
            F32, be.ptr(logits), be.ptr(labels), be.ptr(loss), be.ptr(dl), rows, vocab, -100, None, s
        )

    _ok(run(), "softmax_xent")
    be.sync()
    L = be.host(logits)
    m = L.max(-1, keepdims=True)
    p = np.exp(L - m)
    lse = np.log(p.sum(-1)) + m[:, 0]
    p /= p.sum(-1, keepdims=True)
    valid = lab != -100
    safe = np.where(valid, lab, 0)
    want_loss = np.where(valid, lse - L[np.arange(rows), safe], 0.0)
    grad = p.copy()
    grad[np.arange(rows), safe] -= 1
    grad[~valid] = 0
    res = {"loss": _err(be.host(loss), want_loss), "dlogits": _err(be.host(dl), grad)}
    if timing:
        res["ours_ms"] = _time(be, run)
        res["framework_fwd_ms"] = _time(be, lambda: be.ref_xent(logits, labels))
        res["bytes"] = 2 * rows * vocab * 4 + rows * 12  # logits in, dlogits out, labels, loss
    return res


def _errors(res: Dict[str, float]) -> Dict[str, float]:
    return {k: v for k, v in res.items() if not k.endswith("_ms") and k not in ("bytes", "GBps", "of_peak")}


def _speed(res: Dict[str, float], peak: Optional[float]) -> str:
    """Times, and (for the timed cases) the achieved bandwidth of our fwd + bwd and its fraction of peak;
    recorded into ``res`` too."""
    text = "".join(f"  {k} {v:.3f}" for k, v in res.items() if k.endswith("_ms"))
    if "bytes" in res and res.get("ours_ms"):
        res["GBps"] = res["bytes"] / (res["ours_ms"] * 1e-3) / 1e9
        text += f"  {res['GBps']:.0f} GB/s"
        if peak:
            res["of_peak"] = res["GBps"] * 1e9 / peak
            text += f" ({100 * res['of_peak']:.0f}% of peak)"
    return text


def main(argv: Optional[List[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args(argv if argv is not None else [])
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = build_library(Path(tmp))
        if args.compile_only:
            return {"compiled": True}
        lib = ctypes.CDLL(str(lib_path))
        bind(lib)
        be = pick_backend()
        peak = peak_bandwidth(be)
        print(
            f"device: {be.device_name()}  backend: {be.name}  peak memory bandwidth: "
            + (f"{peak / 1e9:.0f} GB/s" if peak else "unknown")
        )
        dtypes = ["float32", "float16"] + (["bfloat16"] if be.name == "torch" else [])
        rng = np.random.default_rng(0)
        results: Dict[str, Dict[str, float]] = {}
        failures: List[str] = []
        for dtype in dtypes:
            cases = {
                "rms_norm 1x1": (check_rms, (1, 1)),
                "rms_norm 7x4097": (check_rms, (7, 4097)),
                "rms_norm 3x4104": (check_rms, (3, 4104)),  # 16-byte loads, rows not a multiple of a block's
                "rms_norm 8192x4096": (check_rms, (8192, 4096)),
                "swiglu 33": (check_swiglu, (33,)),
                "swiglu 4099": (check_swiglu, (4099,)),  # 16-byte loads and a scalar tail
                "swiglu 4099 unaligned": (check_swiglu, (4099,), {"offset": 1}),
                "swiglu 8192x11008": (check_swiglu, (8192 * 11008,)),
                "rotary 1x1x1x1x2": (check_rotary, (1, 1, 1, 1, 2)),
                "rotary 2x5x3x2x24": (check_rotary, (2, 5, 3, 2, 24)),  # half 12: fp32 loads 4, fp16 scalar
                "rotary 2x3x2x1x16": (check_rotary, (2, 3, 2, 1, 16)),
                "rotary 4x2048x32x8x128": (check_rotary, (4, 2048, 32, 8, 128)),
            }
            for name, (fn, shape, *kw) in cases.items():
                timing = name.endswith("8192x4096") or name.endswith("x11008") or name.endswith("x128")
                res = fn(be, lib, dtype, *shape, rng, timing, **(kw[0] if kw else {}))
                key = f"{name} {dtype}"
                results[key] = res
                errs = _errors(res)
                bad = [k for k, v in errs.items() if not v <= TOL[dtype]]
                if bad:
                    failures.append(f"{key}: {bad}")
                worst = max(errs.values())
                print(
                    f"{key:34s} max rel err {worst:.2e} {'OK' if not bad else 'FAIL'}{_speed(res, peak)}",
                    flush=True,
                )
        for rows, vocab in [(1, 2), (37, 1001), (8192, 32000)]:
            res = check_xent(be, lib, rows, vocab, rng, rows > 1000)
            key = f"softmax_xent {rows}x{vocab} float32"
            results[key] = res
            errs = _errors(res)
            bad = [k for k, v in errs.items() if not v <= 1e-4]
            if bad:
                failures.append(f"{key}: {bad}")
            print(
                f"{key:34s} max rel err {max(errs.values()):.2e} {'OK' if not bad else 'FAIL'}{_speed(res, peak)}",
                flush=True,
            )
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import gpu_check_moe  # the MoE experts' grouped GEMM (kernels/cuda/moe_cuda.cu)

        failures += gpu_check_moe.run(be, lib, dtypes, rng)
        print("ALL OK" if not failures else "FAILURES:\n  " + "\n  ".join(failures))
        results["ok"] = not failures  # type: ignore[assignment]
        return results


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:]).get("ok", True) else 1)
