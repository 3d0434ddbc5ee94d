"""plan/host_memory.py: the reuse/release choice, and that each policy does what it says to glibc malloc
(counted in page faults of a re-allocated block, which do not depend on machine load)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bmtrain_cli.plan import host_memory

GiB = 1 << 30


def test_auto_reuses_when_twice_the_plan_fits_for_every_rank() -> None:
    assert host_memory.choose("auto", 1 * GiB, 8 * GiB) == "reuse"
    assert host_memory.choose("auto", 4 * GiB, 8 * GiB) == "reuse"  # exactly 2x fits
    assert host_memory.choose("auto", 5 * GiB, 8 * GiB) == "release"
    assert host_memory.choose("auto", 2 * GiB, 8 * GiB, ranks=2) == "reuse"
    assert host_memory.choose("auto", 3 * GiB, 8 * GiB, ranks=2) == "release"


def test_auto_without_an_estimate_and_explicit_policies() -> None:
    assert host_memory.choose("auto", None, 8 * GiB) == "reuse"
    assert host_memory.choose("auto", 1 * GiB, 0) == "reuse"  # memory unknown
    assert host_memory.choose("release", 1, 8 * GiB) == "release"
    assert host_memory.choose("reuse", 100 * GiB, 8 * GiB) == "reuse"  # the user's word stands
    with pytest.raises(ValueError, match="unknown host memory policy"):
        host_memory.choose("fast", 1, 1)
    with pytest.raises(ValueError, match="takes 'reuse' or 'release'"):
        host_memory.apply("auto")


_FAULTS = r"""
import ctypes, resource, sys
from bmtrain_cli.plan import host_memory
assert host_memory.apply(sys.argv[1])
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)  # first use: faults in any policy
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc options")
def test_reuse_keeps_freed_pages_and_release_returns_them() -> None:
    def faults(policy: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS, policy], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())

    pages = (64 << 20) // 4096
    assert faults("reuse") < pages // 10  # the 64 MiB block comes back from the heap, already mapped
    if not _huge_pages_always():  # else a fresh mapping faults once per 2 MiB
        assert faults("release") > pages // 2  # a fresh mapping: one fault per 4 KiB page


def _huge_pages_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as fh:
            return "[always]" in fh.read()
    except OSError:
        return False
