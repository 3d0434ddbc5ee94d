"""Paddle's start-up messages that mean nothing to a bmtrain user, dropped where they are produced.

* ``import paddle`` warns "No ccache found" (its C++-extension helper looks for ccache at import time)
  and, when OMP_NUM_THREADS > 1, prints a warning about data parallel and OpenBLAS. ``bmtrain train``
  sets the thread count on purpose (commands/train_cmd.default_threads) and builds its kernels once,
  cached, so neither applies.
* Loading the custom kernels runs a Python subprocess (Paddle's extension builder) that prints both
  again, and Paddle logs "using custom operator only" twice.
* ``fleet.init`` reports its strategy, flags, TCP store and communication groups on every rank.

Only those lines are dropped: everything else written to standard error in the block, by this process
or its children, is passed on as it is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, Sequence

NOISE = (
    "No ccache found",
    "warnings.warn(warning_message)",
    "OMP_NUM_THREADS set to",
    "PLEASE USE OMP_NUM_THREADS WISELY",
    "using custom operator only",
)

# fleet.init's start-up report on every rank: its strategy, the FLAGS the launcher set, the TCP store,
# the communication groups (the same layout `bmtrain train` prints in one line)
FLEET_INIT_NOISE = NOISE + (
    "distributed strategy initialized",
    "Modified FLAGS detected",
    "FLAGS(name=",
    "=================================================================",
    "tcp_store.cc",
    "tcp_utils.cc",
    "comm group(s) create successfully",
    "HybridParallelInfo:",
    "is not in group _default_pg",
    "  warnings.warn(",
)


@contextlib.contextmanager
def filtered_stderr(noise: Sequence[str] = NOISE) -> Iterator[None]:
    """Route file descriptor 2 (child processes included) through a pipe for the block; a thread passes
    every line that does not contain one of ``noise`` on to the real standard error as it comes, so
    nothing is held back if the process stops inside the block."""
    try:
        fd = sys.__stderr__.fileno() if sys.__stderr__ is not None else 2
    except (AttributeError, OSError, ValueError):  # no real stderr (embedded interpreter)
        yield
        return
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    saved = os.dup(fd)
    read_end, write_end = os.pipe()

    patterns = [n.encode() for n in noise]

    def pump() -> None:
        with os.fdopen(read_end, "rb") as src:
            for line in src:
                if not any(n in line for n in patterns):
                    os.write(saved, line)

    thread = threading.Thread(target=pump, name="bmtrain-stderr-filter", daemon=True)
    thread.start()
    os.dup2(write_end, fd)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(saved, fd)  # closes the pipe's last write end held by this process
        thread.join(timeout=5)  # a child still holding the pipe keeps it open; do not wait for it
        if not thread.is_alive():
            os.close(saved)


def import_paddle() -> None:
    """Import Paddle without its start-up noise (a no-op once it is imported)."""
    if "paddle" in sys.modules:
        return
    with filtered_stderr():
        import paddle  # noqa: F401
