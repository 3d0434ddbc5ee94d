"""A digest of every file under a directory, to check that a command changed nothing it should not."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict


def tree_digest(root: Path) -> Dict[str, str]:
    """{relative path: sha256 of the content} of every file under ``root`` (folders are listed too, so a
    removed or added empty folder counts as a change)."""
    root = Path(root)
    out: Dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
    return out
