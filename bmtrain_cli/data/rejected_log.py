"""output_dir/rejected.jsonl: the bad records set aside by on_bad_record: skip, with their reasons.

The token cache knows them all before training (:func:`save_rejected`); a streaming run appends them as
it reaches them (:class:`RejectedLog`): every data rank appends its own records (one ``write`` per line on an O_APPEND file). After a resume the
records already in the file are not written again: the buffer a run resumes in may have been reached
before the stop.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

REJECTED_FILE = "rejected.jsonl"
MAX_REJECTED_LOGGED = 100_000  # per rank; the rest are counted, as in the token cache


def save_rejected(records: Iterable[Dict[str, Any]], count: int, output_dir: Union[str, Path]) -> Path:
    """Write the rejected records to output_dir/rejected.jsonl (atomically); ``count`` is their number
    (more than the records kept when there were very many)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{REJECTED_FILE}.tmp.{os.getpid()}"
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(out / REJECTED_FILE)
    logging.getLogger("bmtrain.data").warning("skipped %d bad record(s); see %s", count, out / REJECTED_FILE)
    return out / REJECTED_FILE


class RejectedLog:
    def __init__(self, path: str, resumed: bool = False):
        self.path = path
        self.resumed = resumed
        self.written = 0
        self._seen: Optional[Set[Tuple[str, int]]] = None

    def _load(self) -> Set[Tuple[str, int]]:
        seen: Set[Tuple[str, int]] = set()
        if self.resumed and os.path.isfile(self.path):
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    r = json.loads(line)
                    seen.add((r["file"], int(r["line"])))
        return seen

    def append(self, rejected: List[Dict[str, Any]]) -> None:
        if not rejected:
            return
        if self._seen is None:
            self._seen = self._load()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            for r in rejected:
                key = (r["file"], int(r["line"]))
                if key in self._seen or self.written >= MAX_REJECTED_LOGGED:
                    continue
                self._seen.add(key)
                self.written += 1
                os.write(fd, (json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
        finally:
            os.close(fd)
