"""Build (and cache) the custom-op extension from kernels/: ``python -m bmtrain_cli.ops.build``.

One Paddle extension holds every op: the C++ CPU kernels always, plus the CUDA launchers when Paddle is a
GPU build and nvcc is found. The sources are the checkout's top-level ``kernels/``, or in an installed
package the copy its wheel carries (``bmtrain_cli/_kernels``, made at build time by
bmtrain_cli/_build_kernels.py). The build goes to ``<cache>/<key>`` where the key hashes the sources, the
flags, the Paddle version, the C++ compiler (path and version), the Python version and the CPU's
instruction set, so an unchanged tree loads in about a second and a changed one rebuilds (a line on
stderr says so while it builds). The cache root is ``$BMTRAIN_KERNELS_CACHE`` or
``~/.cache/bmtrain_cli/kernels``. Concurrent processes (several ranks) serialise on a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from bmtrain_cli.machine import find_cxx


def _kernels_dir() -> Path:
    """The kernel sources: an installed package's copy (bmtrain_cli/_kernels), else the checkout's kernels/."""
    packaged = Path(__file__).resolve().parents[1] / "_kernels"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "kernels"


KERNELS_DIR = _kernels_dir()
CPU_SOURCES = [
    "cpu/fused_cpu.cc",
    "cpu/adamw_cpu.cc",
    "cpu/grad_norm_cpu.cc",
    "cpu/attention_cpu.cc",
    "cpu/quant_cpu.cc",
    "cpu/delta_rule_cpu.cc",
    "cpu/moe_cpu.cc",
    "paddle/fused_ops.cc",
    "paddle/adamw_op.cc",
    "paddle/grad_norm_op.cc",
    "paddle/attention_op.cc",
    "paddle/quant_op.cc",
    "paddle/delta_rule_op.cc",
    "paddle/moe_op.cc",
    "paddle/grouped_gemm_op.cc",
]
CUDA_SOURCES = ["cuda/fused_cuda.cu", "cuda/moe_cuda.cu"]
HEADERS = [
    "include/bmt_kernels.h",
    "cpu/parallel.h",
    "cpu/simd_math.h",
    "cpu/gemm.h",
    "cuda/cuda_common.h",
    "paddle/op_dtype.h",
]
CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]


def link_flags() -> List[str]:
    """Link our OpenMP regions to the OpenMP runtime Paddle already runs (its bundled libiomp5, which also
    serves the GNU ``GOMP_*`` entry points GCC emits), so that MKL's matmuls and our kernels share one
    thread pool. With GCC's libgomp beside it, each runtime's threads spin-wait after their parallel
    regions while the other's want the cores: measured on 2 cores, the fused attention's forward + backward
    took 23.9 ms with 2 threads against 5.9 ms with 1 (and 5.4 ms with 2 and GOMP_SPINCOUNT=0).
    Where Paddle has no libiomp5 (builds without MKL) our kernels use libgomp."""
    import paddle

    libs = Path(paddle.__file__).resolve().parent / "libs"
    iomp = libs / "libiomp5.so"
    mkl = mkl_library()
    shipped = [str(lib) for lib in (mkl, iomp) if lib is not None and lib.is_file()]
    runtime = [] if iomp.is_file() else ["-fopenmp"]
    return shipped + runtime + ([f"-Wl,-rpath,{libs}"] if shipped else [])


def mkl_library() -> Optional[Path]:
    """The MKL (``libmklml_intel.so``) Paddle ships on x86 and runs its CPU matmuls with: the MoE experts'
    grouped GEMM (kernels/cpu/moe_cpu.cc) calls its sgemm, built with ``-DBMT_WITH_MKL``; without it that
    kernel uses its own blocked loops."""
    import paddle

    lib = Path(paddle.__file__).resolve().parent / "libs" / "libmklml_intel.so"
    return lib if lib.is_file() else None


CUDA_FLAGS = ["-O3"]
# without PADDLE_CUDA_ARCH_LIST and without a visible GPU: Ampere and Hopper machine code, plus Hopper
# PTX that the driver compiles for newer GPUs (Blackwell) at the first launch
DEFAULT_CUDA_ARCHS = ("8.0", "9.0+PTX")


def cuda_arch_list(env_value: Optional[str], capabilities: Sequence[Tuple[int, int]]) -> List[str]:
    """The architectures to build for, in PADDLE_CUDA_ARCH_LIST's notation ("8.0", "9.0+PTX"), as Paddle's
    own cpp_extension decides: the variable when set (";" or spaces between entries), else each visible
    GPU's compute capability with PTX on the newest, else :data:`DEFAULT_CUDA_ARCHS`."""
    if env_value and env_value.strip():
        return [a for a in env_value.replace(" ", ";").split(";") if a]
    found = sorted(
        {f"{major}.{minor}" for major, minor in capabilities}, key=lambda a: tuple(map(int, a.split(".")))
    )
    if not found:
        return list(DEFAULT_CUDA_ARCHS)
    found[-1] += "+PTX"
    return found


def cuda_arch_flags(archs: Sequence[str]) -> List[str]:
    """nvcc -gencode flags: machine code for each architecture, and PTX for those marked "+PTX"."""
    flags: List[str] = []
    for arch in archs:
        version = arch.split("+")[0]
        major, _, minor = version.partition(".")
        if not (major.isdigit() and (minor or "0").isdigit()):
            raise KernelBuildError(
                f"PADDLE_CUDA_ARCH_LIST: {arch!r} is not an architecture like 8.0 or 9.0+PTX"
            )
        num = f"{major}{minor or '0'}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if arch.endswith("+PTX"):
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def _visible_capabilities() -> List[Tuple[int, int]]:
    try:
        import paddle

        if not paddle.is_compiled_with_cuda():
            return []
        caps = [paddle.device.cuda.get_device_capability(i) for i in range(paddle.device.cuda.device_count())]
        return [(major, minor) for major, minor in caps]
    except (ImportError, RuntimeError, ValueError, AttributeError):
        return []


def cuda_flags() -> List[str]:
    """CUDA_FLAGS with this machine's architectures (PADDLE_CUDA_ARCH_LIST, else the visible GPUs)."""
    archs = cuda_arch_list(os.environ.get("PADDLE_CUDA_ARCH_LIST"), _visible_capabilities())
    return CUDA_FLAGS + cuda_arch_flags(archs)


class KernelBuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


_loaded: Dict[str, object] = {}


def cache_root() -> Path:
    root = os.environ.get("BMTRAIN_KERNELS_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "bmtrain_cli" / "kernels"


def find_nvcc() -> Optional[str]:
    """Path of nvcc (PATH, then $CUDA_HOME/bin, then /usr/local/cuda/bin), or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    for base in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if base and os.access(os.path.join(base, "bin", "nvcc"), os.X_OK):
            return os.path.join(base, "bin", "nvcc")
    return None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def plan() -> Tuple[List[str], List[str], List[str], bool]:
    """(sources, cxx flags, cuda flags, with_cuda) for this machine."""
    import paddle

    with_cuda = bool(paddle.is_compiled_with_cuda()) and find_nvcc() is not None
    sources = [str(KERNELS_DIR / s) for s in CPU_SOURCES]
    cxx = list(CXX_FLAGS)
    if mkl_library() is not None:
        cxx.append("-DBMT_WITH_MKL")
    cuda: List[str] = []
    if with_cuda:
        sources += [str(KERNELS_DIR / s) for s in CUDA_SOURCES]
        cxx.append("-DBMT_WITH_CUDA")
        cuda = cuda_flags()
    return sources, cxx, cuda, with_cuda


def compiler_id() -> str:
    """The C++ compiler's path and the first line of its ``--version`` ('' without a compiler)."""
    import subprocess

    cxx = find_cxx()
    if cxx is None:
        return ""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return f"{cxx} {(out.splitlines() or [''])[0]}".strip()


def build_key(sources: List[str], cxx: List[str], cuda: List[str]) -> str:
    import paddle

    h = hashlib.sha256()
    for path in sorted(sources) + [str(KERNELS_DIR / s) for s in HEADERS]:
        h.update(path.encode())
        h.update(Path(path).read_bytes())
    for part in (cxx, cuda, link_flags()):
        h.update(" ".join(part).encode())
    h.update(paddle.__version__.encode())
    h.update(compiler_id().encode())
    h.update(sys.version.encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load_extension(verbose: bool = False) -> ModuleType:
    """Build if needed and import the extension; raises KernelBuildError with the reason on failure."""
    if "module" in _loaded:
        return _loaded["module"]  # type: ignore[return-value]
    if "error" in _loaded:
        raise KernelBuildError(str(_loaded["error"]))
    try:
        module = _build(verbose)
    except KernelBuildError as exc:
        _loaded["error"] = exc
        raise
    _loaded["module"] = module
    return module


def _build(verbose: bool) -> ModuleType:
    missing = [s for s in CPU_SOURCES + HEADERS if not (KERNELS_DIR / s).is_file()]
    if missing:
        raise KernelBuildError(f"kernel sources not found under {KERNELS_DIR}: {', '.join(missing)}")
    if find_cxx() is None:
        raise KernelBuildError("no C++ compiler found: install g++ (or set $CXX) to build them")
    try:
        import paddle
        from paddle.utils import cpp_extension  # imported by `import paddle`, which warns about ccache
    except ImportError as exc:  # pragma: no cover - paddle is a precondition of the package
        raise KernelBuildError(f"paddle.utils.cpp_extension unavailable: {exc}") from exc

    sources, cxx, cuda, _ = plan()
    key = build_key(sources, cxx, cuda)
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    from bmtrain_cli.quiet import filtered_stderr

    name = f"bmt_fused_ops_{key}"
    with _file_lock(build_dir / ".lock"):
        fresh = not (build_dir / name / f"{name}.so").is_file()
        if fresh:
            print(
                f"building the custom kernels ({len(sources)} C++{'/CUDA' if cuda else ''} sources: RMSNorm, "
                f"RoPE, SwiGLU, cross-entropy, AdamW, grad norm, attention, quantised linear, delta rule, MoE experts) "
                f"for Paddle {paddle.__version__} "
                f"with the C++ compiler {find_cxx()} into {build_dir}: once per Paddle and compiler, "
                "1-3 minutes on 2 cores",
                file=sys.stderr,
                flush=True,
            )
        try:
            with (
                warnings.catch_warnings(),
                filtered_stderr(),
                _progress("building the custom kernels", fresh),
            ):
                warnings.simplefilter("ignore")
                with contextlib.redirect_stdout(log) if not verbose else contextlib.nullcontext():
                    return cpp_extension.load(
                        name=name,
                        sources=sources,
                        extra_cxx_cflags=cxx,
                        extra_cuda_cflags=cuda,
                        extra_ldflags=link_flags(),
                        extra_include_paths=[str(KERNELS_DIR / "include")],
                        build_directory=str(build_dir),
                        verbose=verbose,
                    )
        except Exception as exc:  # the build runs a compiler in a subprocess; any failure means fall back
            tail = log.getvalue()[-2000:]
            raise KernelBuildError(f"building the custom kernels failed: {exc}\n{tail}".rstrip()) from exc


@contextlib.contextmanager
def _progress(what: str, show: bool, every_s: float = 30.0) -> Iterator[None]:
    """While the block runs, a line every ``every_s`` seconds saying it still does (a compiler gives no
    output for minutes), then one saying how long it took."""
    if not show:
        yield
        return
    done = threading.Event()
    t0 = time.monotonic()

    def tick() -> None:
        while not done.wait(every_s):
            print(f"  ... still {what} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    thread = threading.Thread(target=tick, name="bmtrain-build-progress", daemon=True)
    thread.start()
    try:
        yield
        print(f"  {what}: done in {time.monotonic() - t0:.0f} s (cached for the next runs)", file=sys.stderr)
    finally:
        done.set()
        thread.join()


def compile_cuda_launchers(out_dir: Optional[Path] = None) -> Path:
    """Compile the .cu launchers with nvcc alone (no Paddle) into a shared library; returns its path."""
    import subprocess

    nvcc = find_nvcc()
    if nvcc is None:
        raise KernelBuildError("nvcc not found")
    out_dir = out_dir or cache_root() / "cuda-launchers"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / "libbmt_cuda.so"
    cmd = [
        nvcc,
        *cuda_flags(),
        "-std=c++17",
        "-Xcompiler",
        "-fPIC",
        "-shared",
        f"-I{KERNELS_DIR / 'include'}",
    ]
    cmd += [str(KERNELS_DIR / s) for s in CUDA_SOURCES] + ["-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelBuildError(f"nvcc failed:\n{proc.stderr[-2000:]}")
    return lib


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    sources, cxx, cuda, with_cuda = plan()
    print(f"kernels: {KERNELS_DIR}")
    print(f"cache:   {cache_root() / build_key(sources, cxx, cuda)}")
    archs = " ".join(f.split("code=")[1] for f in cuda if f.startswith("-gencode"))
    print("targets: CPU (C++/OpenMP)" + (f" + CUDA ({archs})" if with_cuda else ""))
    if not with_cuda:
        nvcc = find_nvcc()
        why = "Paddle is a CPU build" if nvcc else "nvcc not found"
        print(f"CUDA ops not built into the extension: {why}")
        if nvcc:
            try:
                print(f"nvcc:    compiled the CUDA launchers alone -> {compile_cuda_launchers()}")
            except KernelBuildError as exc:
                print(f"FAILED: {exc}", file=sys.stderr)
                return 1
    try:
        module = load_extension(verbose=args.verbose)
    except KernelBuildError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    ops = sorted(n for n in dir(module) if n.startswith("bmt_"))
    print(f"built:   {', '.join(ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
