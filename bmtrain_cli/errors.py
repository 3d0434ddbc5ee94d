"""User-facing errors: anything the user can fix is raised as a UserError and exits 2, no traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


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
