"""The record stream of streaming mode: raw lines of the data files in a deterministic order, with a small,
exact position (per source: file, byte offset, line, passes) to resume from.

Without ``data_weights`` the files of every data_path entry are read one after the other and a pass over
all of them is an epoch. With weights each entry is a source read in a cycle of its own, and each next
record comes from a source drawn with probability weight / sum(weights) by a generator seeded with
(seed, draw number // 4096): the draws are a function of the position, not of a stored generator state.

Record n of the whole stream belongs to data rank n % data_world; the other ranks read its bytes and skip
it without parsing, so the ranks share the records with no pre-pass and every record of an epoch goes to
exactly one rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.readers import DataFile, LongLine, is_blank, is_json_array, open_binary
from bmtrain_cli.data.workers import Item
from bmtrain_cli.errors import UserError

DRAW_BLOCK = 4096
JSON_ARRAY = (
    "{path}: a JSON array file cannot be streamed (it is one record of the whole file); convert it to JSONL "
    "(one record per line) or set streaming: false"
)
_SKIP_BLOCK = 1 << 20


@dataclass
class Cursor:
    """Where a source stands: the next line is at byte ``offset`` (decompressed) of ``files[file]``."""

    file: int = 0
    offset: int = 0
    line: int = 0  # lines of that file already read
    records: int = 0  # records of that file already read (-1: the file is empty and was reported)
    passes: int = 0  # completed passes over the source's files


class SourceReader:
    """The records of one source's files in order, from a cursor; ``next()`` is None at the end of a pass
    (the cursor then points at the first file again)."""

    def __init__(self, files: Sequence[str], cursor: Cursor, limit: Optional[int] = None):
        self.files = list(files)
        self.cursor = cursor
        self.limit = limit  # bytes of one line (readers.line_limit)
        self._f: Optional[DataFile] = None

    def _open(self) -> DataFile:
        path = self.files[self.cursor.file]
        f = open_binary(path)
        if is_json_array(f):
            f.close()
            raise UserError(JSON_ARRAY.format(path=path))
        off = self.cursor.offset
        if off and path.endswith((".gz", ".zst")):
            while off > 0:  # compressed: decompress and skip to the offset
                got = len(f.read(min(off, _SKIP_BLOCK)))
                if not got:
                    break
                off -= got
        elif off:
            f.seek(off)
        return f

    def next(self) -> Optional[Item]:
        c = self.cursor
        while True:
            if self._f is None:
                self._f = self._open()
            line = self._f.readline(self.limit)
            if line or isinstance(line, LongLine):
                c.offset += line.size if isinstance(line, LongLine) else len(line)
                c.line += 1
                if is_blank(c.line, line):
                    continue
                c.records += 1
                return (self.files[c.file], c.line, line)
            if c.records == 0:  # an empty file: one bad record; the cursor moves on at the next call
                c.records = -1
                return (self.files[c.file], 1, None)
            self._f.close()
            self._f = None
            c.file, c.offset, c.line, c.records = c.file + 1, 0, 0, 0
            if c.file == len(self.files):
                c.file = 0
                c.passes += 1
                return None

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class RecordStream:
    """This data rank's records, chunk by chunk; :meth:`state` is the position before the next one."""

    def __init__(
        self,
        sources: Sequence[Sequence[str]],
        weights: Optional[Sequence[float]],
        seed: int,
        data_rank: int = 0,
        data_world: int = 1,
        state: Optional[Dict[str, Any]] = None,
        limit: Optional[int] = None,
    ):
        if weights is not None and len(weights) != len(sources):
            raise UserError(f"{len(weights)} data_weights for {len(sources)} data sources")
        self.weighted = weights is not None and len(sources) > 1
        groups = [list(s) for s in sources] if self.weighted else [[f for s in sources for f in s]]
        st = state or {}
        cursors = [Cursor(**c) for c in st.get("cursors", [])] or [Cursor() for _ in groups]
        if len(cursors) != len(groups):
            raise UserError("cannot resume the stream: the number of data sources changed")
        self.readers = [SourceReader(g, c, limit) for g, c in zip(groups, cursors)]
        p = np.asarray(weights if self.weighted else [1.0], dtype=np.float64)
        self._p = p / p.sum()
        self.seed = int(seed)
        self.rank, self.world = int(data_rank), int(data_world)
        self.n = int(st.get("n", 0))  # records of the whole stream read so far (all ranks)
        self._draws: Tuple[int, Optional[np.ndarray]] = (-1, None)

    def state(self) -> Dict[str, Any]:
        return {"n": self.n, "cursors": [asdict(r.cursor) for r in self.readers]}

    @property
    def passes(self) -> int:
        """Completed passes of the source that has made the fewest (the epoch without weights)."""
        return min(r.cursor.passes for r in self.readers)

    def _source(self) -> int:
        if not self.weighted:
            return 0
        block = self.n // DRAW_BLOCK
        if self._draws[0] != block:
            rng = np.random.default_rng([self.seed, 0x5EED, block])
            self._draws = (block, rng.choice(len(self._p), size=DRAW_BLOCK, p=self._p))
        return int(self._draws[1][self.n % DRAW_BLOCK])  # type: ignore[index]

    def take(self, count: int) -> Tuple[List[Item], bool]:
        """Up to ``count`` records of this rank, and whether an epoch ended (unweighted: the chunk stops
        there). A weighted source that reaches its end starts its next pass at once."""
        items: List[Item] = []
        while len(items) < count:
            reader = self.readers[self._source()]
            item = reader.next()
            if item is None:
                if not self.weighted:
                    return items, True
                item = reader.next()
                if item is None:  # pragma: no cover - a source always holds a record or an empty file
                    continue
            if self.n % self.world == self.rank:
                items.append(item)
            self.n += 1
        return items, False

    def close(self) -> None:
        for r in self.readers:
            r.close()
