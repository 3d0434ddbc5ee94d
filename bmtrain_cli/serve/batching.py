"""Continuous batching: one scheduler thread owns the model and decodes every active request together.

Requests waiting between two decode steps are prefilled together, as one left-padded batch (padding
masked, positions counting each row's real tokens: what ``models.generate`` runs for several prompts), and
join the batch. The batch keeps one preallocated KV cache of all its rows (serve/kv_slots.py), each row
right-aligned and left-padded to the longest: its attention mask marks each row's real tokens (1) and
padding (0, which no query sees) and each row has its own positions, so a row computes what it would
alone. Each decode step feeds every active row its last token as one batched forward, writing the new
keys and values in place; a row leaves on EOS, a stop string, max_tokens or cancellation (the last row
takes its place), and the columns every remaining row pads are dropped. Each row picks its tokens and
stops through its own ``models.decoding.DecodeStep`` (its request's options and seed, the same step
``models.generate`` runs): a request's tokens do not depend on who shares its batch. One host sync per
step: the last position's logits (``models.decoding.next_logits``), read once for all rows.

Models whose rotary tables depend on the whole batch's longest position (dynamic NTK, LongRoPE), models
with linear-attention layers (their cache is a recurrent state) and paddle-inference exports (no cache input) are not batched: their requests run one at a time through
``models.generate`` / ``export.loading.generate_static`` on the same thread."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import paddle

from bmtrain_cli.models.blocks import KVCache
from bmtrain_cli.models.decoding import (
    DecodeStep,
    SamplingOptions,
    TokenCallback,
    left_pad,
    next_logits,
    prompt_positions,
)
from bmtrain_cli.models.generate import generate
from bmtrain_cli.serve.kv_slots import SlotCache, prefilled

UNBATCHED_ROPE = ("dynamic", "longrope")  # rotary tables computed from the batch's largest position


@dataclass
class Job:
    """One generation: prompt ids, its decoding options, ``on_token(row, token) -> stop`` and
    ``cancelled``."""

    ids: List[int]
    options: SamplingOptions
    on_token: TokenCallback
    cancelled: Callable[[], bool]
    done: Future[None] = field(default_factory=Future)
    step: Optional[DecodeStep] = None  # from the prefill on
    length: int = 0  # tokens in this row's cache
    last: int = -1  # the token to feed next


def batchable(model: Any) -> bool:
    """Whether ``model``'s requests can share decode steps (see the module docstring)."""
    if getattr(model, "predictor", None) is not None or model.arch.linear_attention is not None:
        return False  # a linear-attention layer's cache is a recurrent state, not rows of keys to pad
    scaling = model.arch.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type")) not in UNBATCHED_ROPE


class Batch:
    """The rows being decoded: their jobs, in the order of their rows in the preallocated cache."""

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.jobs: List[Job] = []
        self.cache = SlotCache(num_layers, max_rows)

    def __len__(self) -> int:
        return len(self.jobs)

    def join(
        self, jobs: List[Job], keys: List[paddle.Tensor], values: List[paddle.Tensor], mask: np.ndarray
    ) -> None:
        self.cache.join(keys, values, mask)
        self.jobs += jobs

    def drop(self, rows: List[int]) -> None:
        if rows:
            order = self.cache.drop(rows)
            self.jobs = [self.jobs[i] for i in order]


class Scheduler:
    """The thread that owns the model: ``submit`` queues a job; the thread prefills waiting jobs
    (at most ``max_batch`` rows at once) and runs decode steps over all active rows."""

    def __init__(self, model: Any, max_batch: int = 32) -> None:
        self.model = model
        self.max_batch = max_batch
        self.batched = batchable(model)
        self.steps = 0  # decode steps run (each one forward over all active rows)
        self.widest = 0  # the most rows one decode step has held
        self.tokens = 0  # tokens generated
        self.cancelled = 0  # rows that ended with their client gone
        self.active = 0  # rows in the batch now
        self._incoming: queue.Queue[Job] = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()

    def stats(self) -> Dict[str, int]:
        """The counters above, for /health."""
        keys = ("max_batch", "active", "steps", "widest", "tokens", "cancelled")
        return {k: int(getattr(self, k)) for k in keys}

    def submit(self, job: Job) -> Future[None]:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="bmtrain-scheduler", daemon=True)
                self._thread.start()
        self._incoming.put(job)
        return job.done

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        self.model.eval()
        batch = Batch(len(self.model.layers), self.max_batch) if self.batched else None
        while True:
            if batch is None:
                self._alone(self._incoming.get())
                continue
            first = None if batch else self._incoming.get()  # idle: sleep until a job comes
            try:
                self._admit(batch, first)
                self.active = len(batch)
                if batch:
                    self._step(batch)
                self.active = len(batch)
            except Exception as exc:  # fail the rows involved, keep serving the next ones
                for job in batch.jobs:
                    _fail(job, exc)
                batch.drop(list(range(len(batch))))
                self.active = 0

    def _admit(self, batch: Batch, job: Optional[Job]) -> None:
        """Prefill ``job`` and the jobs waiting (up to max_batch rows) together and add them to the batch."""
        jobs = [] if job is None else [job]
        while len(batch) + len(jobs) < self.max_batch:
            try:
                jobs.append(self._incoming.get_nowait())
            except queue.Empty:
                break
        live = []
        for job in jobs:
            if job.cancelled():
                self.cancelled += 1
                job.done.set_result(None)
            else:
                live.append(job)
        if not live:
            return
        try:
            self._prefill(batch, live)
        except Exception as exc:
            for job in live:
                _fail(job, exc)

    @paddle.no_grad()
    def _prefill(self, batch: Batch, jobs: List[Job]) -> None:
        """Run the prompts as one left-padded batch (padding masked, positions counting real tokens, as
        ``models.generate`` does), take each row's first token and add the rows that go on to the batch."""
        ids, mask = left_pad([job.ids for job in jobs])
        cache = KVCache(len(self.model.layers))
        logits = next_logits(self.model, ids, mask, prompt_positions(mask), cache)
        going = []
        for i, job in enumerate(jobs):
            job.step = DecodeStep(job.options, 1, job.on_token)
            job.length = len(job.ids)
            if self._take(job, logits[i : i + 1]):
                going.append(i)
        if not going:
            return
        keys, values = prefilled(cache)
        if len(going) < len(jobs):
            index = paddle.to_tensor(going, dtype="int64")
            keys = [paddle.gather(k, index) for k in keys]
            values = [paddle.gather(v, index) for v in values]
        batch.join([jobs[i] for i in going], keys, values, mask[going])

    @paddle.no_grad()
    def _step(self, batch: Batch) -> None:
        """One decode step: every active row's last token in one forward, then one token per row."""
        gone = [i for i, job in enumerate(batch.jobs) if job.cancelled()]
        for i in gone:
            self.cancelled += 1
            batch.jobs[i].done.set_result(None)
        batch.drop(gone)
        if not batch:
            return
        batch.cache.reserve(1)
        rows = next_logits(
            self.model,
            np.asarray([[job.last] for job in batch.jobs], dtype=np.int64),
            batch.cache.step_mask(),
            np.asarray([[job.length] for job in batch.jobs], dtype=np.int64),
            batch.cache,
        )
        self.steps += 1
        self.widest = max(self.widest, len(batch))
        ended = []
        for i, job in enumerate(batch.jobs):
            job.length += 1
            if not self._take(job, rows[i : i + 1]):
                ended.append(i)
        batch.drop(ended)

    def _take(self, job: Job, logits: np.ndarray) -> bool:
        """The row's next token, handed over by its decode step; False (and the job done) when the row
        ends."""
        assert job.step is not None
        job.last = int(job.step(logits, [0])[0])
        self.tokens += 1
        if job.step.done[0]:
            self.cancelled += int(job.cancelled())
            job.done.set_result(None)
        return not job.step.done[0]

    def _alone(self, job: Job) -> None:
        """A request of an unbatched model, start to end (the paddle-inference path or a batch-dependent rope)."""
        if job.cancelled():
            job.done.set_result(None)
            return
        try:
            if getattr(self.model, "predictor", None) is not None:
                from bmtrain_cli.export.loading import generate_static

                generate_static(self.model, [job.ids], job.options, on_token=job.on_token)
            else:
                generate(self.model, [job.ids], job.options, on_token=job.on_token)
        except Exception as exc:
            _fail(job, exc)
            return
        job.done.set_result(None)


def _fail(job: Job, exc: BaseException) -> None:
    if not job.done.done():
        job.done.set_exception(exc)
