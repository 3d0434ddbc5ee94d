"""Continuous batching: one scheduler thread owns the model and decodes every active request together.

A request is prefilled alone (its prompt as one row with no padding, exactly as `bmtrain generate`
runs it) into its own KV cache, then joins the batch between two decode steps. The batch keeps one
cache of all its rows, left-padded to the longest: its attention mask marks each row's real tokens
(1) and padding (0, which no query sees) and each row has its own positions, so a row computes what it
would alone. Each decode step feeds every active row its last token as one batched forward; a row
leaves on EOS, a stop string, max_tokens or cancellation, and the columns every remaining row pads
are cut off. Sampling is per row with the row's own seeded generator (``models.generate.sample_next``):
a request's tokens do not depend on who shares its batch.

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
from bmtrain_cli.models.generate import TokenCallback, generate, sample_next

UNBATCHED_ROPE = ("dynamic", "longrope")  # rotary tables computed from the batch's largest position


@dataclass
class Job:
    """One generation: prompt ids, sampling, ``on_token(row, token) -> stop`` and ``cancelled``."""

    ids: List[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    on_token: TokenCallback
    cancelled: Callable[[], bool]
    done: Future[None] = field(default_factory=Future)
    rng: Any = None
    length: int = 0  # tokens in this row's cache
    last: int = -1  # the token to feed next
    produced: int = 0


def batchable(model: Any) -> bool:
    """Whether ``model``'s requests can share decode steps (see the module docstring)."""
    if getattr(model, "predictor", None) is not None or model.arch.linear_attention is not None:
        return False  # a linear-attention layer's cache is a recurrent state, not rows of keys to pad
    scaling = model.arch.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type")) not in UNBATCHED_ROPE


class Batch:
    """The rows being decoded: their jobs, one KV cache left-padded to the longest row, the mask."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.jobs: List[Job] = []
        self.cache = KVCache(num_layers)
        self.mask = np.zeros((0, 0), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.jobs)

    def join(self, job: Job, cache: KVCache) -> None:
        """Add a prefilled row (its own cache, batch 1, ``job.length`` tokens)."""
        width, n = self.mask.shape[1], job.length
        if not self.jobs:
            self.cache, self.mask = cache, np.ones((1, n), dtype=np.int64)
            self.jobs = [job]
            return
        grow = max(n - width, 0)
        if grow:
            self.cache = _left_padded(self.cache, grow)
            self.mask = np.pad(self.mask, ((0, 0), (grow, 0)))
        width += grow
        new = _left_padded(cache, width - n) if width > n else cache
        self.cache.keys = [
            paddle.concat([a, b]) for a, b in zip(_tensors(self.cache.keys), _tensors(new.keys))
        ]
        self.cache.values = [
            paddle.concat([a, b]) for a, b in zip(_tensors(self.cache.values), _tensors(new.values))
        ]
        row = np.zeros((1, width), dtype=np.int64)
        row[0, width - n :] = 1
        self.mask = np.concatenate([self.mask, row], axis=0)
        self.jobs.append(job)

    def keep(self, rows: List[int]) -> None:
        """Keep only ``rows`` (the others finished), then drop the columns that are padding in all."""
        if len(rows) == len(self.jobs):
            return
        self.jobs = [self.jobs[i] for i in rows]
        if not rows:
            self.cache, self.mask = KVCache(self.num_layers), np.zeros((0, 0), dtype=np.int64)
            return
        self.cache.select(paddle.to_tensor(rows, dtype="int64"))
        self.mask = self.mask[rows]
        lead = self.mask.shape[1] - max(j.length for j in self.jobs)
        if lead > 0:
            self.mask = self.mask[:, lead:]
            self.cache.keys = [k[:, lead:] for k in _tensors(self.cache.keys)]
            self.cache.values = [v[:, lead:] for v in _tensors(self.cache.values)]


def _tensors(per_layer: List[Optional[paddle.Tensor]]) -> List[paddle.Tensor]:
    """A prefilled cache's keys (or values) of every layer (none is missing once a prompt ran)."""
    out = [t for t in per_layer if t is not None]
    assert len(out) == len(per_layer)
    return out


def _left_padded(cache: KVCache, n: int) -> KVCache:
    """A copy of ``cache`` with ``n`` zero positions before every row's keys and values."""

    def pad(t: paddle.Tensor) -> paddle.Tensor:
        return paddle.concat([paddle.zeros([t.shape[0], n, *t.shape[2:]], dtype=t.dtype), t], axis=1)

    out = KVCache(len(cache.keys))
    out.keys = [pad(k) for k in _tensors(cache.keys)]
    out.values = [pad(v) for v in _tensors(cache.values)]
    return out


class Scheduler:
    """The thread that owns the model: ``submit`` queues a job; the thread prefills waiting jobs
    (at most ``max_batch`` rows at once) and runs decode steps over all active rows."""

    def __init__(self, model: Any, eos_id: Optional[int], max_batch: int = 32) -> None:
        self.model = model
        self.eos_id = eos_id
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
        batch = Batch(len(self.model.layers)) if self.batched else None
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
                batch.keep([])
                self.active = 0

    def _admit(self, batch: Batch, job: Optional[Job]) -> None:
        """Prefill ``job`` and the jobs waiting (up to max_batch rows) and add them to the batch."""
        while len(batch) < self.max_batch:
            if job is None:
                try:
                    job = self._incoming.get_nowait()
                except queue.Empty:
                    return
            try:
                cache = self._prefill(job)
            except Exception as exc:
                _fail(job, exc)
                cache = None
            if cache is not None:
                batch.join(job, cache)
            job = None

    @paddle.no_grad()
    def _prefill(self, job: Job) -> Optional[KVCache]:
        """Run the prompt alone; None when the job is already over (cancelled, or its first token ends it)."""
        if job.cancelled():
            self.cancelled += 1
            job.done.set_result(None)
            return None
        job.rng = np.random.default_rng(job.seed)
        n = len(job.ids)
        cache = KVCache(len(self.model.layers))
        logits = self.model(
            paddle.to_tensor([job.ids], dtype="int64"),
            attention_mask=paddle.ones([1, n], dtype="int64"),
            position_ids=paddle.arange(n, dtype="int64").unsqueeze(0),
            cache=cache,
        )
        job.length = n
        return cache if self._take(job, logits[:, -1].astype("float32").numpy()) else None

    @paddle.no_grad()
    def _step(self, batch: Batch) -> None:
        """One decode step: every active row's last token in one forward, then one token per row."""
        live = [i for i, job in enumerate(batch.jobs) if not job.cancelled()]
        for i, job in enumerate(batch.jobs):
            if i not in live:
                self.cancelled += 1
                job.done.set_result(None)
        batch.keep(live)
        if not batch:
            return
        batch.mask = np.concatenate([batch.mask, np.ones((len(batch), 1), dtype=np.int64)], axis=1)
        logits = self.model(
            paddle.to_tensor([[job.last] for job in batch.jobs], dtype="int64"),
            attention_mask=paddle.to_tensor(batch.mask),
            position_ids=paddle.to_tensor([[job.length] for job in batch.jobs], dtype="int64"),
            cache=batch.cache,
        )
        self.steps += 1
        self.widest = max(self.widest, len(batch))
        rows = logits[:, -1].astype("float32").numpy()
        keep = []
        for i, job in enumerate(batch.jobs):
            job.length += 1
            if self._take(job, rows[i : i + 1]):
                keep.append(i)
        batch.keep(keep)

    def _take(self, job: Job, logits: np.ndarray) -> bool:
        """Sample the row's next token and hand it over; False (and the job done) when the row ends."""
        token = int(sample_next(logits, job.temperature, job.top_p, job.rng)[0])
        job.produced += 1
        self.tokens += 1
        job.last = token
        stop = job.on_token(0, token) or token == self.eos_id or job.produced >= job.max_tokens
        if stop:
            self.cancelled += int(job.cancelled())
            job.done.set_result(None)
        return not stop

    def _alone(self, job: Job) -> None:
        """A request of an unbatched model, start to end (the paddle-inference path or a batch-dependent rope)."""
        if job.cancelled():
            job.done.set_result(None)
            return
        args = (job.max_tokens, job.temperature, job.top_p, self.eos_id, job.seed)
        try:
            if getattr(self.model, "predictor", None) is not None:
                from bmtrain_cli.export.loading import generate_static

                generate_static(self.model, [job.ids], *args, on_token=job.on_token)
            else:
                generate(self.model, [job.ids], *args, on_token=job.on_token)
        except Exception as exc:
            _fail(job, exc)
            return
        job.done.set_result(None)


def _fail(job: Job, exc: BaseException) -> None:
    if not job.done.done():
        job.done.set_exception(exc)
