"""How freed host (CPU) memory is handled while training on a CPU: kept for reuse, or returned to the OS.

Paddle's CPU allocator hands every tensor to glibc malloc, and a training step allocates and frees its
activations and gradients anew. Two policies (``train_config.host_memory``):

- ``reuse``: freed memory stays in the malloc heap for the next tensors (``M_MMAP_MAX`` 0, a high
  ``M_TRIM_THRESHOLD``). A step then touches almost no fresh pages. Measured on the SmolLM2-135M shape
  (2 x 190 tokens, fp32 AdamW, 2 threads; docs/benchmarks.md "Host memory policy"): 15.9k page faults and
  0.13 s of kernel time per step, against 814k faults and 1.76 s with ``release``; the process's peak RSS
  4.13 GB against 3.13 GB (freed blocks of one size are not always reused for another).
- ``release``: glibc's mmap threshold is pinned at its starting value (``M_MMAP_THRESHOLD`` 128 KiB), so
  every tensor-sized block is its own mapping, returned on free: peak RSS ~= the live tensors + a constant
  (without pinning, glibc raises the threshold after the first large free and the heap keeps 1.4-1.8x
  the live tensors on small models), at the price of a page fault per 4 KiB of every new tensor.

``auto`` takes ``reuse`` when the memory plan's estimate times ``REUSE_HEADROOM`` (per rank, all ranks of
the machine) fits in the machine's memory, else ``release``: the fast policy wherever memory allows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Callable, Optional

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
DEFAULT_THRESHOLD = 128 << 10
KEEP_BYTES = (1 << 31) - 1  # M_TRIM_THRESHOLD is an int: the heap keeps up to 2 GiB of free top memory
POLICIES = ("auto", "reuse", "release")
# reuse's peak RSS over the live tensors: 1.32x measured on the 135M shape, up to 1.8x on small models
REUSE_HEADROOM = 2.0

_applied: Optional[str] = None


def _libc() -> Optional[ctypes.CDLL]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _mallopt() -> Optional[Callable[[int, int], int]]:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def trim() -> bool:
    """Return the malloc heap's free pages to the OS now (glibc ``malloc_trim``; False elsewhere). Called
    after ``kernels: auto``'s timing (before the policy is chosen), whose freed tensors would otherwise stay
    resident and be counted in none of the run's memory figures but its resident set."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is None:
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))


def choose(policy: str, estimate_bytes: Optional[int], host_bytes: int, ranks: int = 1) -> str:
    """``reuse`` or ``release`` for a configured policy; ``auto`` from the plan's per-rank estimate (None:
    no estimate, taken as fitting) against the machine's memory shared by ``ranks`` processes."""
    if policy not in POLICIES:
        raise ValueError(f"unknown host memory policy {policy!r} (choose one of {', '.join(POLICIES)})")
    if policy != "auto":
        return policy
    if estimate_bytes is None or host_bytes <= 0:
        return "reuse"
    return "reuse" if estimate_bytes * REUSE_HEADROOM * max(ranks, 1) <= host_bytes else "release"


def apply(policy: str) -> bool:
    """Set glibc malloc for ``reuse`` or ``release`` (Linux/glibc only; elsewhere nothing changes and the
    answer is False). Call when CPU training starts; calling again with the same policy is a no-op."""
    global _applied
    if policy not in ("reuse", "release"):
        raise ValueError(f"apply() takes 'reuse' or 'release', got {policy!r}")
    if _applied == policy:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if policy == "reuse":
        ok = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    else:
        ok = all(
            mallopt(option, value)
            for option, value in (
                (M_MMAP_MAX, 65536),  # glibc's defaults, should reuse have been set before
                (M_TRIM_THRESHOLD, DEFAULT_THRESHOLD),
                (M_MMAP_THRESHOLD, DEFAULT_THRESHOLD),
            )
        )
    _applied = policy if ok else None
    return ok
