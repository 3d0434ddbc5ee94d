"""Parsing and tokenising records in worker processes, with results in submission order.

The parent reads raw lines (cheap) and hands them out in tasks; ``data_workers`` processes parse, validate
and tokenise them. Task k goes to worker k % N and each worker answers its tasks in order, so the parent
reads the answers back round-robin: the output order never depends on worker timing, and the queues are
bounded (at most ``depth`` tasks waiting per worker), so memory does not grow with the file.

Workers are forked where the platform can (as Paddle's and PyTorch's data loaders do: no re-import of the
user's main module, which ``spawn`` would run again without an ``if __name__ == "__main__"`` guard), else
spawned; they only parse and tokenise, never touch Paddle. They rebuild the encoder from an
:class:`EncodeSpec` and check that the tokenizer they rebuilt has the parent's fingerprint.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.collate import TRUNC_ANSWER, truncate
from bmtrain_cli.data.encode import Encoder
from bmtrain_cli.data.formats import BadRecord, parse_record
from bmtrain_cli.data.readers import EMPTY_FILE, parse_line
from bmtrain_cli.data.turns import DEFAULT
from bmtrain_cli.errors import UserError

# one record handed to a worker: (file, line, the line's bytes; None = the file has no record at all)
Item = Tuple[str, int, Optional[bytes]]
NO_TRAINED_TOKEN = "no trained token"
MAX_DEFAULT_WORKERS = 8


def default_workers(cpus: Optional[int] = None) -> int:
    """``data_workers`` when unset: half the CPUs (the rest train), at least 1, at most 8."""
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_WORKERS, n // 2))


@dataclass(frozen=True)
class EncodeSpec:
    """Everything a worker needs to encode records exactly as the parent would (picklable)."""

    tokenizer: Any  # (class, model payload, settings) for the built-in backends, else the object itself
    fingerprint: str
    template: Any  # a built-in template's name, "tokenizer" (its chat template), else the object itself
    train_on_prompt: bool
    data_format: str
    max_seq_len: Optional[int] = None  # None: keep samples whole (the token cache)
    truncation: str = "left"
    bos_id: Optional[int] = None
    options: Any = None  # RenderOptions (data/turns.py)
    chat_template_file: Optional[str] = None  # named in the chat template's errors

    @classmethod
    def of(
        cls,
        encoder: Encoder,
        data_format: str,
        max_seq_len: Optional[int] = None,
        truncation: str = "left",
    ) -> EncodeSpec:
        from bmtrain_cli.data.templates import BUILTIN_TEMPLATES, JinjaTemplate
        from bmtrain_cli.data.tokenizers import HFTokenizer, SentencePieceTokenizer

        tok = encoder.tokenizer
        recipe: Any = tok
        if isinstance(tok, SentencePieceTokenizer):
            recipe = (SentencePieceTokenizer, tok._bytes, tok.settings)
        elif isinstance(tok, HFTokenizer):
            recipe = (HFTokenizer, tok._json, tok.settings)
        template: Any = encoder.template
        name: Any = getattr(template, "name", None)
        if BUILTIN_TEMPLATES.get(name) is template:
            template = name
        elif isinstance(template, JinjaTemplate) and template.source == tok.chat_template:
            template = "tokenizer"
        return cls(
            recipe,
            tok.fingerprint(),
            template,
            encoder.train_on_prompt,
            data_format,
            max_seq_len,
            truncation,
            tok.bos_id,
            encoder.options,
            getattr(tok, "chat_template_file", None),
        )

    def build(self) -> Encoder:
        from bmtrain_cli.data.templates import get_template

        tok = self.tokenizer
        if isinstance(tok, tuple):
            kind, payload, settings = tok
            tok = kind(payload, settings)
            tok.chat_template_file = self.chat_template_file
        if tok.fingerprint() != self.fingerprint:
            raise RuntimeError("a data worker rebuilt a different tokenizer than the trainer's")
        template = get_template(self.template, tok) if isinstance(self.template, str) else self.template
        return Encoder(tok, template, self.train_on_prompt, self.options or DEFAULT)


@dataclass
class Encoded:
    """The answer to one task: its good samples concatenated, and what happened to the others.

    ``index`` gives each good sample's position in the task; ``bad`` the (position, reason, raw text)
    of rejected records; ``dropped`` the positions of samples over max_seq_len with truncation: drop.
    """

    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, 1 = trained
    offsets: np.ndarray  # int64, n + 1
    index: np.ndarray  # int64, n
    overlong: np.ndarray  # bool, n: longer than max_seq_len before truncation
    answer_cut: np.ndarray  # bool, n: truncation had to cut the answer
    bad: List[Tuple[int, str, str]] = field(default_factory=list)
    dropped: List[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.index)

    def sample(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.mask[a:b]


def encode_items(encoder: Encoder, spec: EncodeSpec, items: Sequence[Item]) -> Encoded:
    """Parse, validate and tokenise one task's records (in a worker, or inline with data_workers 0)."""
    bad: List[Tuple[int, str, str]] = []
    pending: List[Tuple[int, Any]] = []
    for i, (path, line, raw) in enumerate(items):
        if raw is None:
            bad.append((i, EMPTY_FILE, ""))
            continue
        rec = parse_line(path, line, raw)
        if rec.error is not None:
            bad.append((i, rec.error, rec.raw))
            continue
        try:
            pending.append((i, parse_record(rec.value, spec.data_format)))
        except BadRecord as exc:
            bad.append((i, str(exc), rec.raw))
    encoded = encoder.encode_many([conv for _, conv in pending]) if pending else []
    ids_out: List[np.ndarray] = []
    mask_out: List[np.ndarray] = []
    index: List[int] = []
    overlong: List[bool] = []
    cut: List[bool] = []
    dropped: List[int] = []
    limit = spec.max_seq_len
    for (i, _), (ids, mask) in zip(pending, encoded):
        if not any(mask):
            path, line, raw = items[i]
            bad.append((i, NO_TRAINED_TOKEN, (raw or b"").decode("utf-8", "replace").rstrip("\r\n")))
            continue
        a = np.asarray(ids, dtype=np.int32)
        m = np.asarray(mask, dtype=np.uint8)
        long_ = limit is not None and len(a) > limit
        answer_cut = False
        if long_ and spec.truncation == "drop":
            dropped.append(i)
            continue
        if long_:
            assert limit is not None  # long_: over the limit
            (a, m), kind = truncate(a, m.astype(bool), limit, spec.bos_id)
            m = m.astype(np.uint8)
            answer_cut = kind == TRUNC_ANSWER
        ids_out.append(a)
        mask_out.append(m)
        index.append(i)
        overlong.append(long_)
        cut.append(answer_cut)
    bad.sort()
    lens = [len(a) for a in ids_out]
    return Encoded(
        tokens=np.concatenate(ids_out) if ids_out else np.zeros(0, np.int32),
        mask=np.concatenate(mask_out) if mask_out else np.zeros(0, np.uint8),
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        index=np.asarray(index, dtype=np.int64),
        overlong=np.asarray(overlong, dtype=bool),
        answer_cut=np.asarray(cut, dtype=bool),
        bad=bad,
        dropped=dropped,
    )


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int) -> None:
    """In a worker: die with the parent whatever kills it (SIGKILL too), and let SIGTERM end the worker.

    A forked worker inherits the trainer's signal handlers (SIGTERM would run the trainer's graceful stop
    in the worker, which then waits forever); Linux's parent-death signal kills it the moment its parent
    thread exits, and the bounded waits in the loop (queue timeouts that check the parent pid) cover the
    other platforms. Ctrl-C reaches the whole process group: the parent handles it and stops the workers.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the pid checks remain
            pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)


def _worker_main(spec: EncodeSpec, tasks: Any, results: Any, parent: int) -> None:
    """Encode tasks until told to stop; exit by itself when the parent is gone (e.g. killed)."""
    _end_with_parent(parent)

    def put(answer: Tuple[str, Any]) -> bool:
        while os.getppid() == parent:
            try:
                results.put(answer, timeout=1.0)
                return True
            except queue.Full:
                continue
        return False

    try:
        encoder = spec.build()
    except BaseException:
        put(("error", traceback.format_exc()))
        return
    while os.getppid() == parent:
        try:
            items = tasks.get(timeout=1.0)
        except queue.Empty:
            continue
        if items is None:
            return
        try:
            answer: Tuple[str, Any] = ("ok", encode_items(encoder, spec, items))
        except UserError as exc:  # e.g. the chat template hit a limit: the parent says it in one line
            put(("user error", str(exc)))
            return
        except BaseException:
            put(("error", traceback.format_exc()))
            return
        if not put(answer):
            return


class OrderedPool:
    """``workers`` processes encoding tasks; :meth:`map` yields their answers in task order.

    With ``workers == 0`` tasks are encoded inline (no process; with ``encoder`` when given). One
    :meth:`map` at a time.
    """

    def __init__(self, spec: EncodeSpec, workers: int, depth: int = 2, encoder: Optional[Encoder] = None):
        self.spec = spec
        self.workers = int(workers)
        self.depth = max(1, int(depth))
        self._procs: List[Any] = []
        self._tasks: List[Any] = []
        self._results: List[Any] = []
        self._encoder: Optional[Encoder] = None
        if self.workers <= 0:
            self._encoder = encoder if encoder is not None else spec.build()
            return
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
        for k in range(self.workers):
            tq, rq = ctx.Queue(maxsize=self.depth), ctx.Queue(maxsize=self.depth)
            p = ctx.Process(
                target=_worker_main, args=(spec, tq, rq, os.getpid()), name=f"bmtrain-data-{k}", daemon=True
            )
            p.start()
            self._procs.append(p)
            self._tasks.append(tq)
            self._results.append(rq)

    def _get(self, k: int) -> Encoded:
        while True:
            try:
                status, value = self._results[k].get(timeout=1.0)
                break
            except queue.Empty:
                if not self._procs[k].is_alive():
                    raise RuntimeError(
                        f"data worker {k} died (exit code {self._procs[k].exitcode}); "
                        "lower data_workers if the machine ran out of memory"
                    ) from None
        if status == "user error":
            raise UserError(value)
        if status == "error":
            if "a data worker rebuilt a different tokenizer" in value:
                raise UserError("a data worker rebuilt a different tokenizer than the trainer's")
            raise RuntimeError(f"data worker {k} failed:\n{value}")
        return value

    def map(self, tasks: Iterable[Sequence[Item]]) -> Generator[Encoded, None, None]:
        """The answers to ``tasks`` in their order; at most workers x depth tasks are in flight."""
        if self._encoder is not None:
            for items in tasks:
                yield encode_items(self._encoder, self.spec, items)
            return
        it = iter(tasks)
        sent = got = 0
        limit = self.workers * self.depth
        exhausted = failed = False
        try:
            while True:
                while not exhausted and sent - got < limit:
                    task = next(it, None)
                    if task is None:
                        exhausted = True
                        break
                    self._tasks[sent % self.workers].put(list(task))
                    sent += 1
                if got == sent:
                    return
                try:
                    answer = self._get(got % self.workers)
                except Exception:
                    failed = True
                    raise
                got += 1
                yield answer
        finally:  # abandoned early: take the answers still in flight, so the next map starts clean
            if not failed and all(p.is_alive() for p in self._procs):
                while got < sent:
                    self._get(got % self.workers)
                    got += 1

    def close(self) -> None:
        for tq, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    tq.put(None, timeout=1.0)
                except queue.Full:
                    pass
        for p in self._procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)
        self._procs, self._tasks, self._results = [], [], []

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
