"""A random sample of the records of data files, for ``bmtrain data-stats --sample N``.

Plain JSONL files are sampled without reading them: N byte offsets are drawn uniformly over all the
files, and each gives the record that starts after it (a record is then drawn with probability
proportional to the length of the line before it, which is unbiased when a record's length does not
depend on its neighbour's, e.g. in a shuffled file). Compressed files and JSON arrays cannot be entered
at an offset: their records are read through (not tokenised) and sampled with a seeded reservoir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.cache import TokenStore
from bmtrain_cli.data.readers import RawRecord, is_blank, raw_records
from bmtrain_cli.data.workers import Encoded, EncodeSpec, Item, OrderedPool

TASK_RECORDS = 256


@dataclass
class Sample:
    items: List[Item]
    bytes_total: int  # size of every sampled file on disk
    read_through: List[str]  # files that had to be read to be sampled (compressed, JSON arrays)
    rejected_in_reading: List[RawRecord]  # bad records a JSON array's parse found


def _seekable(path: str) -> bool:
    if path.endswith((".gz", ".zst")):
        return False
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
    return not head.lstrip(b"\xef\xbb\xbf").lstrip().startswith(b"[")


def _at_offsets(path: str, offsets: Sequence[int]) -> List[Item]:
    """The record starting after each byte offset (offset 0: the first record), each record once."""
    out: List[Item] = []
    seen = set()
    with open(path, "rb") as f:
        for off in offsets:
            f.seek(off)
            if off:
                f.readline()  # the rest of the line the offset fell in
            while True:
                start = f.tell()
                line = f.readline()
                if not line:
                    break
                if not is_blank(1 if start == 0 else 0, line):
                    if start not in seen:
                        seen.add(start)
                        out.append((path, 1 if start == 0 else 0, line))  # line 0: not counted
                    break
    return out


def _reservoir(paths: Sequence[str], n: int, rng: np.random.Generator) -> Tuple[List[Item], List[RawRecord]]:
    kept: List[Item] = []
    bad: List[RawRecord] = []
    seen = 0
    for path in paths:
        for x in raw_records(path):
            if isinstance(x, RawRecord):
                bad.append(x)
                continue
            seen += 1
            if len(kept) < n:
                kept.append(x)
            else:
                j = int(rng.integers(seen))
                if j < n:
                    kept[j] = x
    return kept, bad


def sample_records(files: Sequence[str], n: int, seed: int = 0) -> Sample:
    """About ``n`` records of ``files`` (fewer when the files hold fewer), without reading plain files."""
    rng = np.random.default_rng([seed, 0x5A])
    plain = [f for f in files if _seekable(f)]
    other = [f for f in files if f not in plain]
    sizes = np.asarray([os.path.getsize(f) for f in plain], dtype=np.int64)
    total_plain = int(sizes.sum())
    n_plain = n if not other else int(round(n * total_plain / max(1, total_plain + _sizes(other))))
    items: List[Item] = []
    if total_plain and n_plain:
        draws = np.sort(rng.integers(0, total_plain, size=n_plain))
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for i, path in enumerate(plain):
            mine = draws[(draws >= starts[i]) & (draws < starts[i + 1])] - starts[i]
            items += _at_offsets(path, mine.tolist())
    bad: List[RawRecord] = []
    if other:
        more, bad = _reservoir(other, n - len(items), rng)
        items += more
    return Sample(items, total_plain + _sizes(other), other, bad)


def _sizes(paths: Sequence[str]) -> int:
    return sum(os.path.getsize(p) for p in paths)


def sample_store(sample: Sample, spec: EncodeSpec, workers: int) -> TokenStore:
    """The sampled records tokenised (as the token cache would) into one in-memory store."""
    tasks = [sample.items[i : i + TASK_RECORDS] for i in range(0, len(sample.items), TASK_RECORDS)]
    with OrderedPool(spec, workers) as pool:
        parts: List[Encoded] = list(pool.map(tasks))
    rejected = [{"file": r.file, "line": r.line, "reason": r.error} for r in sample.rejected_in_reading]
    lines: List[int] = []
    for task, enc in zip(tasks, parts):
        rejected += [{"file": task[i][0], "line": task[i][1], "reason": why} for i, why, _ in enc.bad]
        lines += [task[int(i)][1] for i in enc.index]
    offsets = [0]
    for enc in parts:
        offsets += (offsets[-1] + enc.offsets[1:]).tolist()
    return TokenStore(
        file=f"sample of {len(sample.items)} records",
        directory=Path("(sample)"),
        tokens=np.concatenate([e.tokens for e in parts]) if parts else np.zeros(0, np.int32),
        mask=np.concatenate([e.mask for e in parts]) if parts else np.zeros(0, np.uint8),
        offsets=np.asarray(offsets, dtype=np.int64),
        lines=np.asarray(lines, dtype=np.int64),
        records=len(sample.items) + len(sample.rejected_in_reading),
        rejected=rejected,
        rejected_count=len(rejected),
    )
