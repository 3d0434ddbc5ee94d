"""User-facing errors: anything the user can fix is raised as a UserError and exits 2, no traceback."""

from __future__ import annotations

import contextlib
import errno
import re
from dataclasses import dataclass
from typing import Iterator, List, Optional


class UserError(Exception):
    """An error caused by the user's input (config, data, arguments). The CLI prints it and exits 2."""

    exit_code = 2


class NoticeWarning(UserWarning):
    """A warning meant for the user (a fallback, a degraded mode), which the CLI prints as one line
    (``warning: ...``), without Python's file:line and source echo."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or worth a warning) in a config, with where it came from."""

    message: str
    path: str = ""
    file: Optional[str] = None
    line: Optional[int] = None
    column: Optional[int] = None
    suggestion: Optional[str] = None
    severity: str = "error"  # "error" | "warning"

    def format(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        field = f"{self.path}: " if self.path else ""
        text = f"{where}{self.severity}: {field}{self.message}"
        if self.suggestion:
            text += f" ({self.suggestion})"
        return text


class ConfigError(UserError):
    """One or more problems in a config; ``str()`` lists them all, one per line."""

    def __init__(self, problems: List[Problem], partial: Optional[object] = None):
        self.problems = problems
        self.partial = partial  # best-effort Config with the failing fields dropped (loader internal)
        super().__init__("\n".join(p.format() for p in problems))


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG)
_DENIED = (errno.EROFS, errno.EACCES, errno.EPERM)


def write_error_line(exc: BaseException, where: object = None) -> Optional[str]:
    """One line for a failed write (a full disk, a read-only or forbidden path), naming the place: from
    an OSError, a short write ("N requested and M written", numpy's), or a SafetensorError wrapping the
    OS error (its text carries the code). None for anything else."""
    code = getattr(exc, "errno", None)
    text = str(exc)
    if code is None:
        m = re.search(r"\(os error (\d+)\)", text)  # safetensors: "I/O error: No space ... (os error 28)"
        code = int(m.group(1)) if m else None
    if code is None and re.search(r"\d+ requested and \d+ written", text):
        code = errno.ENOSPC  # a short write: the device filled up
    place = where or getattr(exc, "filename", None) or "the output device"
    if code in _FULL:
        return f"no space left on {place}"
    if code == errno.EROFS:
        return f"cannot write {place}: read-only file system"
    if code in _DENIED:
        return f"cannot write {place}: permission denied"
    return None


class WriteError(UserError):
    """A file could not be written (disk full, read-only, permission); the message names the place."""


def user_write_error(exc: BaseException, where: object = None) -> Optional[WriteError]:
    """:func:`write_error_line` as a UserError to raise (None: not a write failure, re-raise it)."""
    line = write_error_line(exc, where)
    return (
        WriteError(f"{line}; free space or fix permissions (or write elsewhere) and run again")
        if line
        else None
    )


@contextlib.contextmanager
def writes_to(where: object) -> Iterator[None]:
    """Turn a write failure inside the block (OSError, or safetensors' SafetensorError wrapping one) into
    a WriteError naming ``where``; anything else passes unchanged."""
    try:
        yield
    except Exception as exc:
        write_failure = isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError"
        error = user_write_error(exc, where) if write_failure else None
        if error is None:
            raise
        raise error from None
