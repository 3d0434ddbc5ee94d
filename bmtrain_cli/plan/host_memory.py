"""Host (CPU) memory behaviour that the planner relies on.

Paddle's CPU allocator hands tensors to glibc malloc. By default glibc raises its mmap threshold each
time a large block is freed (up to 32 MiB), after which tensors below that size come from the malloc
heap, whose freed chunks stay resident: on Paddle 3.3.1 the peak RSS of a training step was 1.4-1.8x
the live tensors, varying with shapes. Pinning the threshold (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``,
glibc's own starting value) keeps every tensor-sized block in its own mapping that is returned on free,
so peak RSS ~= peak live tensors + a constant: less memory and a predictable peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3
DEFAULT_THRESHOLD = 128 << 10

_applied = False


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold so freed tensor memory goes back to the OS (Linux/glibc only).
    Returns whether it was applied. Call once when CPU training starts; safe to call again."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, int(threshold)))
    return _applied
