"""A one-line progress bar on stderr for `bmtrain eval --task` (redrawn on a terminal; elsewhere one
closing line, so logs stay readable)."""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    def __init__(self, total: int, label: str, stream: Optional[TextIO] = None):
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self._drawn = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and (now - self._drawn > 0.2 or self.done >= self.total):
            self._drawn = now
            width = 30
            filled = int(width * self.done / self.total)
            rate = self.done / max(now - self.started, 1e-9)
            self.stream.write(
                f"\r{self.label} [{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.total} "
                f"({rate:.1f}/s)"
            )
            self.stream.flush()

    def close(self) -> None:
        seconds = time.perf_counter() - self.started
        self.stream.write(
            ("\n" if self.tty else "") + f"{self.label}: {self.done} scored in {seconds:.1f}s\n"
        )
        self.stream.flush()
