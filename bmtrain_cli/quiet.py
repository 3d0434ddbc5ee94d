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

`bmtrain run` shows the launcher's output without the error dumps of the ranks (LauncherConsole).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, List, Optional, Sequence

NOISE = (
    "No ccache found",
    "warnings.warn(warning_message)",
    "OMP_NUM_THREADS set to",
    "PLEASE USE OMP_NUM_THREADS WISELY",
    "using custom operator only",
)

# Paddle's internal notices while saving a static graph (paddle.jit.save: a UserWarning about a Tensor's
# 'place', PIR's "not support input out tensor") and while a Paddle Inference predictor runs on a CPU (its
# oneDNN pass prints "ReduceMeanCheckIfOneDNNSupport" on the first runs): `bmtrain export` and
# `bmtrain generate`/`eval` on an export
INFERENCE_NOISE = NOISE + (
    "Tensor do not have 'place' interface",
    "not support input out tensor",
    "ReduceMeanCheckIfOneDNNSupport",
    "  warnings.warn(",
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


# Python prints these between the tracebacks of a chained exception
_CHAINED = (
    b"During handling of the above exception, another exception occurred:",
    b"The above exception was the direct cause of the following exception:",
)


_NOISE_BYTES = tuple(n.encode() for n in NOISE)
# the first line of each error dump the console drops, and the state it opens
_DUMP_OPENERS = (
    (b"C++ Traceback (most recent call last):", "cpp"),
    (b"Error Message Summary:", "summary"),
    (b"Traceback (most recent call last):", "python"),
    (b"terminate called after throwing", "exception"),
)


def _dump_opened_by(text: bytes) -> Optional[str]:
    """The state an error dump starting with ``text`` opens, None when ``text`` opens none."""
    if text in _CHAINED:  # "During handling of the above exception ..." between chained tracebacks
        return "python"
    return next((state for prefix, state in _DUMP_OPENERS if text.startswith(prefix)), None)


class LauncherConsole:
    """What `bmtrain run` shows of the launcher's output: everything except error dumps, which the worker
    logs keep and the clear ``error: distributed run failed: ...`` line replaces.

    Paddle's launcher copies local rank 0's worker log to its standard output every 2 s; when a rank
    fails it logs "Container failed !!!" and then copies the last 3000 bytes of that rank's log (from
    the middle of a line, repeating what was shown). When one rank dies, the others stop inside a
    collective with a gloo error. Dropped: Python tracebacks (frames, exception line and its indented
    continuation, chained tracebacks), Paddle's C++ error dumps ("C++ Traceback" / "Error Message
    Summary" blocks, as its signal handler also prints them), C++ ``terminate called ...`` aborts, the
    start-up warnings of ``NOISE`` (every rank's ``import paddle`` with OMP_NUM_THREADS > 1), and
    everything from "Container failed" on. Lines starting with ``error: `` (the ranks' one-line errors)
    are always shown. ``feed`` takes one line at a time, so normal output passes as it comes; only a line
    of dashes waits for the next line (it may open a C++ dump)."""

    def __init__(self) -> None:
        self.state = "normal"  # normal | python | exception | cpp | summary | summary-message | done
        self.held: Optional[bytes] = None

    def feed(self, line: bytes) -> List[bytes]:
        """The lines to show now for ``line`` (none, ``line``, or a held line of dashes and ``line``)."""
        text = line.rstrip(b"\r\n")
        held, self.held = self.held, None
        if self.state == "done" or b"Container failed !!!" in text:
            self.state = "done"
            return []
        if any(n in text for n in _NOISE_BYTES):  # Paddle's import-time warnings, echoed from rank 0
            return [] if held is None else [held]
        if text.startswith(b"error: "):
            self.state = "normal"
            return [held, line] if held is not None else [line]
        opened = _dump_opened_by(text)
        if opened is not None:
            self.state = opened
            return []
        kept = [] if held is None else [held]
        dashes = len(text) >= 10 and not text.strip(b"-")
        continuation = not text.strip() or text[:1] in (b" ", b"\t", b"[")
        if self.state == "python":
            if not continuation:  # the exception line ends the frames
                self.state = "exception"
            return kept
        if self.state in ("exception", "summary-message"):
            if dashes:
                self.state = "cpp"
            if dashes or continuation:
                return kept
            self.state = "normal"
        elif self.state == "cpp":
            return kept
        elif self.state == "summary":
            if not (dashes or continuation):  # the error's name and message
                self.state = "summary-message"
            return kept
        if dashes:
            self.held = line
            return kept
        return kept + [line]

    def close(self) -> List[bytes]:
        """What is still held at the end of the output (a last line of dashes)."""
        held, self.held = self.held, None
        return [] if held is None or self.state == "done" else [held]
