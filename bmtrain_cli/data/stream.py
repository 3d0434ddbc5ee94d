"""Streaming mode: train on JSONL far larger than memory, from the first filled buffer, resuming exactly.

The record stream (stream_reader.py) is cut into chunks of ``shuffle_buffer`` records of this data rank.
A background thread reads a chunk's lines, the worker pool (workers.py) parses and tokenises them in order
(while the previous chunk is being trained on), and the chunk's samples are put in the order of a permutation seeded with (seed, chunk number), packed
(the rows of a chunk are closed at its end) or laid out one per row, and cut into micro-batches; the rows
of a micro-batch may come from two chunks. At most two chunks are held (the one being consumed and the
next one being read), so memory is bounded by the buffer and not by the file.

Position: the reader's state at the start of a chunk (per source: file, byte offset, line, passes), the
chunk number and the rows of it already handed out. Resuming re-reads and re-tokenises that one chunk,
regenerates its order from the seed and skips the rows already trained on: the state is a few integers.

Bad records: with on_bad_record "skip" they are appended to output_dir/rejected.jsonl as their chunk is
reached; with "error" the loader raises a :class:`DataError` naming file:line at the step boundary before
the chunk that holds the record, with its position left at that boundary, so a checkpoint written then
resumes at the last good step. Under data parallel the ranks agree on stopping at every step boundary.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import queue
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Generator, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.background import in_background, put_unless_stopped
from bmtrain_cli.data.cache import template_id
from bmtrain_cli.data.collate import collate, pack
from bmtrain_cli.data.readers import is_json_array, line_limit, open_binary
from bmtrain_cli.data.rejected_log import REJECTED_FILE, RejectedLog
from bmtrain_cli.data.stream_reader import JSON_ARRAY, RecordStream
from bmtrain_cli.data.workers import Encoded, EncodeSpec, Item, OrderedPool
from bmtrain_cli.errors import UserError

TASK_RECORDS = 256  # records per worker task
PACK_WINDOW = 16
COUNTS = ("records", "samples", "rejected", "overlong", "truncated_answer", "dropped")
Batch = Dict[str, np.ndarray]


_LIVE: weakref.WeakSet[StreamLoader] = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    """Stop reading threads before the interpreter finalises: a daemon thread killed inside the
    tokenizer's C++ code aborts the process ("terminate called without an active exception")."""
    for loader in list(_LIVE):
        loader.close()


class DataError(UserError):
    """A bad record stopped a streaming run (on_bad_record: error); the loader's position is the step
    boundary before it."""


@dataclass
class _Chunk:
    k: int
    start: Dict[str, Any]  # reader state before the chunk
    end: Dict[str, Any]  # reader state after it (= before chunk k + 1)
    samples: List[Tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    units: List[List[int]] = field(default_factory=list)
    rejected: List[Dict[str, Any]] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None


@dataclass
class _Item:
    """One micro-batch for the consumer, the position after it and what its chunks reported."""

    batch: Optional[Batch]
    position: Dict[str, Any]
    rejected: List[Dict[str, Any]] = field(default_factory=list)
    counts: Dict[str, int] = field(default_factory=dict)
    error: Optional[BaseException] = None


def file_fingerprint(path: str) -> List[Any]:
    """Name, size and a hash of the first and last 64 KiB: notices a changed file without reading it all."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        if size > 1 << 16:
            f.seek(max(1 << 16, size - (1 << 16)))
            h.update(f.read(1 << 16))
    return [os.path.abspath(path), size, h.hexdigest()]


class StreamLoader:
    """Iterate this data rank's micro-batches of a stream; never ends (epochs follow each other).

    ``state_dict()`` / ``load_state_dict()`` resume exactly. ``agree(flag)`` (sum over all ranks) and
    ``gather(obj)`` (every rank's object) are the collectives of a multi-rank run; None in one process.
    """

    def __init__(
        self,
        sources: Sequence[Sequence[str]],
        spec: EncodeSpec,
        *,
        micro_batch_size: int,
        pad_id: int,
        batching: str = "longest",
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int = 10000,
        weights: Optional[Sequence[float]] = None,
        data_rank: int = 0,
        data_world: int = 1,
        workers: int = 1,
        on_bad_record: str = "error",
        step_batches: int = 1,
        agree: Optional[Callable[[int], int]] = None,
        gather: Optional[Callable[[Any], List[Any]]] = None,
        notice: str = "",
    ):
        if spec.max_seq_len is None:
            raise ValueError("streaming needs max_seq_len in its EncodeSpec")
        self.sources = [list(s) for s in sources]
        self.spec = spec
        self.max_seq_len = int(spec.max_seq_len)
        self.micro_batch_size = int(micro_batch_size)
        self.pad_id = int(pad_id)
        self.batching = batching
        self.shuffle = shuffle
        self.seed = int(seed)
        self.shuffle_buffer = int(shuffle_buffer)
        self.weights = list(weights) if weights else None
        self.data_rank, self.data_world = int(data_rank), int(data_world)
        self.workers = int(workers)
        self.on_bad_record = on_bad_record
        self.step_batches = max(1, int(step_batches))
        self.rejected: Optional[RejectedLog] = None  # set by start_rejected_log
        self.agree, self.gather = agree, gather
        self.notice = notice
        self.files = [f for s in self.sources for f in s]
        for f in self.files:  # refused now rather than when the stream reaches them
            with open_binary(f) as fh:
                if is_json_array(fh):
                    raise UserError(JSON_ARRAY.format(path=f))
        self.fingerprint = self._fingerprint()
        self._pos: Dict[str, Any] = {"reader": None, "chunk": 0, "units": 0}
        self.counts = dict.fromkeys(COUNTS, 0)
        self._resumed = False
        self._pool: Optional[OrderedPool] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._ready: Deque[_Item] = deque()

    # ---- identity
    def _fingerprint(self) -> str:
        s = self.spec
        parts = [
            [file_fingerprint(f) for f in self.files],
            [len(x) for x in self.sources],
            s.fingerprint,
            s.template if isinstance(s.template, str) else template_id(s.template),
            s.train_on_prompt,
            s.data_format,
            s.max_seq_len,
            s.truncation,
        ]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    @property
    def epoch(self) -> int:
        reader = self._pos.get("reader") or {}
        return min((c["passes"] for c in reader.get("cursors", [])), default=0)

    @property
    def longest(self) -> int:
        """Without a pre-pass the longest sample is not known: the bound max_seq_len."""
        return self.max_seq_len

    def __len__(self) -> int:
        raise TypeError("a streaming loader does not know its length without reading all the data")

    # ---- producer (background thread)
    def _tasks(self, stream: RecordStream, metas: Deque[Any]) -> Iterator[List[Item]]:
        k = int(self._pos["chunk"])
        while True:
            start = stream.state()
            items, _ = stream.take(self.shuffle_buffer)
            n_tasks = max(1, -(-len(items) // TASK_RECORDS))
            metas.append((k, start, stream.state(), [(f, ln) for f, ln, _ in items], n_tasks))
            for j in range(n_tasks):
                yield items[j * TASK_RECORDS : (j + 1) * TASK_RECORDS]
            k += 1

    def _chunks(self) -> Generator[_Chunk, None, None]:
        pos = self._pos
        stream = RecordStream(
            self.sources,
            self.weights,
            self.seed,
            self.data_rank,
            self.data_world,
            state=pos["reader"],
            limit=line_limit(self.spec.max_seq_len),
        )
        metas: Deque[Any] = deque()
        answers = self._pool.map(self._tasks(stream, metas))  # type: ignore[union-attr]
        try:
            while True:
                first = next(answers)
                k, start, end, where, n_tasks = metas.popleft()
                parts = [first] + [next(answers) for _ in range(n_tasks - 1)]
                yield self._assemble(k, start, end, where, parts)
        finally:
            answers.close()
            stream.close()

    def _assemble(
        self, k: int, start: Dict[str, Any], end: Dict[str, Any], where: List[Any], parts: List[Encoded]
    ) -> _Chunk:
        ch = _Chunk(k, start, end)
        base = 0
        counts = dict.fromkeys(COUNTS, 0)
        for enc in parts:
            for i, reason, raw in enc.bad:
                f, ln = where[base + i]
                if self.on_bad_record == "error" and ch.error is None:
                    ch.error = f"{f}:{ln}: {reason}"
                ch.rejected.append({"file": f, "line": ln, "reason": reason, "record": raw})
            for j in range(len(enc)):
                ch.samples.append(enc.sample(j))
            counts["overlong"] += int(enc.overlong.sum()) + len(enc.dropped)
            counts["truncated_answer"] += int(enc.answer_cut.sum())
            counts["dropped"] += len(enc.dropped)
            base += len(enc.bad) + len(enc) + len(enc.dropped)
        counts["records"] = len(where)
        counts["samples"] = len(ch.samples)
        counts["rejected"] = len(ch.rejected)
        ch.counts = counts
        n = len(ch.samples)
        order = np.random.default_rng([self.seed, k]).permutation(n) if self.shuffle else np.arange(n)
        if self.batching == "packed":
            lengths = np.asarray([len(ids) for ids, _ in ch.samples], dtype=np.int64)
            ch.units = pack(order, lengths, self.max_seq_len, PACK_WINDOW)
        else:
            ch.units = [[int(i)] for i in order]
        return ch

    def _items(self) -> Iterator[_Item]:
        """Micro-batches from the current position, each with the position after it."""
        skip = int(self._pos["units"])
        first_k = int(self._pos["chunk"])
        usable = int(self._pos.get("usable", 0))
        passes = self.epoch
        rows: List[List[Tuple[np.ndarray, np.ndarray]]] = []
        rejected: List[Dict[str, Any]] = []
        counts: Dict[str, int] = dict.fromkeys(COUNTS, 0)
        width = None if self.batching == "longest" else self.max_seq_len
        for ch in in_background(self._chunks):  # the next buffer is read while this one trains
            if ch.error is not None:
                yield _Item(None, {}, error=DataError(ch.error))
                return
            start_at = skip if ch.k == first_k else 0
            if start_at == 0:  # a chunk reached for the first time reports its records
                rejected.extend(ch.rejected)
                for key in COUNTS:
                    counts[key] += ch.counts[key]
            before, usable = usable, usable + len(ch.samples)  # usable samples of this pass
            end_passes = min(c["passes"] for c in ch.end["cursors"])
            if end_passes > passes:
                if usable == 0:
                    yield _Item(None, {}, error=DataError(self._nothing_usable()))
                    return
                passes, usable = end_passes, 0
            for u in range(start_at, len(ch.units)):
                rows.append([ch.samples[s] for s in ch.units[u]])
                if len(rows) < self.micro_batch_size:
                    continue
                last = u + 1 == len(ch.units)
                position = {
                    "reader": ch.end if last else ch.start,
                    "chunk": ch.k + 1 if last else ch.k,
                    "units": 0 if last else u + 1,
                    "usable": usable if last else before,
                }
                yield _Item(collate(rows, self.pad_id, width), position, rejected, counts)
                rows, rejected, counts = [], [], dict.fromkeys(COUNTS, 0)

    def _nothing_usable(self) -> str:
        where = ", ".join(self.files[:3]) + (
            f" and {len(self.files) - 3} more" if len(self.files) > 3 else ""
        )
        rank = f" for data rank {self.data_rank} of {self.data_world}" if self.data_world > 1 else ""
        return f"no usable record{rank} in a whole pass over {where} (see rejected.jsonl / on_bad_record)"

    def _run(self, q: queue.Queue[_Item], stop: threading.Event) -> None:
        try:
            for item in self._items():
                if not put_unless_stopped(q, item, stop) or item.error is not None:
                    return
        except UserError as exc:  # a data problem (unreadable file, nothing usable): stop at a step boundary
            put_unless_stopped(
                q, _Item(None, {}, error=exc if isinstance(exc, DataError) else DataError(str(exc))), stop
            )
        except BaseException as exc:  # handed to the consumer
            put_unless_stopped(q, _Item(None, {}, error=exc), stop)

    # ---- consumer
    def _start(self) -> None:
        self._halt()
        _LIVE.add(self)
        if self._pool is None:
            self._pool = OrderedPool(self.spec, self.workers)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=2 * self.step_batches + 2)
        self._ready = deque()
        self._thread = threading.Thread(
            target=self._run, args=(self._queue, self._stop), name="bmtrain-stream", daemon=True
        )
        self._thread.start()

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            while self._thread.is_alive():
                try:
                    self._queue.get(timeout=0.1)
                except queue.Empty:
                    pass
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop the reading thread and the worker processes."""
        self._halt()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __iter__(self) -> Iterator[Batch]:
        self._start()
        return self

    def _fill_step(self) -> None:
        """Take the next optimizer step's micro-batches; stop (every rank together) before a bad one."""
        items: List[_Item] = []
        failed: Optional[BaseException] = None
        while len(items) < self.step_batches and failed is None:
            item = self._queue.get()
            items.append(item)
            failed = item.error
        if self.agree is not None and self.agree(1 if failed is not None else 0):
            # every rank stops at this step; each says what stopped it (a bad record on some rank)
            said = self.gather(str(failed) if failed is not None else None) if self.gather else []
            if failed is None:
                failed = DataError(next((m for m in said if m), "another data rank stopped on a bad record"))
        if failed is not None:
            self._halt()
            raise failed
        self._ready.extend(items)

    def __next__(self) -> Batch:
        if self._thread is None:
            self._start()
        if not self._ready:
            self._fill_step()
        item = self._ready.popleft()
        if self.rejected is not None:
            self.rejected.append(item.rejected)
        for key in COUNTS:
            self.counts[key] += item.counts.get(key, 0)
        self._pos = item.position
        return item.batch  # type: ignore[return-value]

    # ---- rejected records
    def start_rejected_log(self, output_dir: str, is_main: bool = True) -> None:
        """Rejected records are appended to output_dir/rejected.jsonl from now on (every rank)."""
        self.rejected = RejectedLog(os.path.join(str(output_dir), REJECTED_FILE), resumed=self._resumed)

    # ---- resume
    def _own_state(self) -> Dict[str, Any]:
        return {"data_rank": self.data_rank, "position": self._pos, "counts": dict(self.counts)}

    def state_dict(self) -> Dict[str, Any]:
        """The position of every data rank (collective under data parallel: every rank calls it)."""
        mine = self._own_state()
        everyone = self.gather(mine) if self.gather is not None else [mine]
        return {
            "mode": "stream",
            "seed": self.seed,
            "batching": self.batching,
            "shuffle_buffer": self.shuffle_buffer,
            "micro_batch_size": self.micro_batch_size,
            "data_world": self.data_world,
            "data_fingerprint": self.fingerprint,
            "epoch": self.epoch,
            "ranks": {str(s["data_rank"]): s for s in everyone},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("mode") != "stream":
            raise UserError(
                "cannot resume: the checkpoint was trained from the token cache and this run streams "
                "(set streaming: false to resume it)"
            )
        for key in ("seed", "batching", "shuffle_buffer", "micro_batch_size", "data_world"):
            if state.get(key) != getattr(self, key):
                raise UserError(
                    f"cannot resume the stream exactly: the checkpoint used {key}={state.get(key)!r}, "
                    f"this run {getattr(self, key)!r}"
                )
        if state.get("data_fingerprint") != self.fingerprint:
            raise UserError(
                "cannot resume the stream exactly: the data files, tokenizer, template or max_seq_len "
                "changed since the checkpoint was written"
            )
        mine = state["ranks"][str(self.data_rank)]
        self._halt()
        self._pos = dict(mine["position"])
        self.counts = {k: int(mine["counts"].get(k, 0)) for k in COUNTS}
        self._resumed = True
        if self.rejected is not None:
            self.rejected.resumed = True

    # ---- reporting
    def stats(self) -> Dict[str, Any]:
        """What is known without a pre-pass: the records reached so far on this rank."""
        return {
            **self.counts,
            "truncated": self.counts["overlong"] if self.spec.truncation == "left" else 0,
            "streaming": True,
            "files": len(self.files),
            "line": self.notice,
        }
