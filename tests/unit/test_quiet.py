"""Paddle's start-up noise is dropped from standard error, everything else is kept (bmtrain_cli/quiet.py)."""

from __future__ import annotations

import subprocess
import sys


def test_filtered_stderr_drops_only_the_noise_of_this_process_and_its_children() -> None:
    code = r"""
import os, subprocess, sys
from bmtrain_cli.quiet import filtered_stderr
with filtered_stderr():
    print("WARNING: OMP_NUM_THREADS set to 2, not 1.", file=sys.stderr)
    os.write(2, b"a real problem\n")
    subprocess.run([sys.executable, "-c", "import sys; print('PLEASE USE OMP_NUM_THREADS WISELY.', file=sys.stderr); print('child error', file=sys.stderr)"])
print("after", file=sys.stderr)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["a real problem", "child error", "after"]


def test_filtered_stderr_passes_output_on_when_the_block_fails() -> None:
    code = r"""
import sys
from bmtrain_cli.quiet import filtered_stderr
try:
    with filtered_stderr():
        print("compiler said: error", file=sys.stderr)
        raise RuntimeError("boom")
except RuntimeError:
    print("caught", file=sys.stderr)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["compiler said: error", "caught"]
