"""output_dir/rejected.jsonl written as a streaming run reaches its bad records (on_bad_record: skip).

Every data rank appends its own records (one ``write`` per line on an O_APPEND file). After a resume the
records already in the file are not written again: the buffer a run resumes in may have been reached
before the stop.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Set, Tuple

MAX_REJECTED_LOGGED = 100_000  # per rank; the rest are counted, as in the token cache


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
