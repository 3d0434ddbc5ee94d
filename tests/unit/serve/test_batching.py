"""The continuous-batching scheduler on a tiny model in-process: rows that join mid-decode, leave on
EOS, max_tokens or cancellation, and sample with their own seeds give what `models.generate` gives
each prompt alone (what `bmtrain generate` runs)."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, List, Optional

import pytest

from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.models.generate import generate
from bmtrain_cli.serve.batching import Job, Scheduler, batchable
from tests.unit.models.tiny import TINY

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [1], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]


@pytest.fixture(scope="module")
def model():
    import paddle

    from bmtrain_cli.models import build

    paddle.seed(3)
    return build(replace(TINY, vocab_size=300))


class Row:
    """A job and the tokens it produced; ``then(k, fn)`` calls fn once the row has k tokens."""

    def __init__(
        self,
        ids: List[int],
        n: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        eos: Optional[int] = None,
    ):
        self.tokens: List[int] = []
        self.cancel = threading.Event()
        self.hooks: List[tuple] = []
        options = SamplingOptions(n, temperature, top_p, eos, seed)
        self.job = Job(ids, options, self._on_token, self.cancel.is_set)

    def _on_token(self, _row: int, token: int) -> bool:
        self.tokens.append(token)
        for k, fn in self.hooks:
            if len(self.tokens) == k:
                fn()
        return False

    def then(self, k: int, fn: Callable[[], None]) -> Row:
        self.hooks.append((k, fn))
        return self


def _alone(model, ids, n, temperature=0.0, top_p=1.0, seed=0, eos: Optional[int] = None) -> List[int]:
    return generate(model, [ids], SamplingOptions(n, temperature, top_p, eos, seed))[0]


def _wait(rows: List[Row]) -> None:
    for r in rows:
        r.job.done.result(timeout=120)


def test_rows_joining_mid_decode_equal_each_prompt_alone(model):
    """Each prompt joins once the previous row has 3 tokens (the last one longer than every row in the
    batch, so the batch's cache grows on the left); all four decode together and equal generate alone."""
    sched = Scheduler(model)
    rows = [Row(p, 10 + 2 * i) for i, p in enumerate(PROMPTS)]
    for prev, nxt in zip(rows, rows[1:]):
        prev.then(3, lambda nxt=nxt: sched.submit(nxt.job))
    sched.submit(rows[0].job)
    _wait(rows)
    assert [r.tokens for r in rows] == [_alone(model, p, 10 + 2 * i) for i, p in enumerate(PROMPTS)]
    assert sched.widest == 4 and sched.active == 0
    assert sched.steps < sum(len(r.tokens) for r in rows) - len(rows)  # decode steps were shared
    assert sched.stats()["tokens"] == sum(len(r.tokens) for r in rows)


def test_seeded_sampling_is_the_same_alone_and_batched(model):
    args = [(p, 12, 1.0, 0.9, 100 + i) for i, p in enumerate(PROMPTS)]
    want = [_alone(model, *a) for a in args]
    sched = Scheduler(model)
    rows = [Row(*a) for a in args]
    for r in rows:
        sched.submit(r.job)
    _wait(rows)
    assert [r.tokens for r in rows] == want
    assert sched.widest > 1 and len({tuple(w) for w in want}) == len(want)
    again = Row(*args[2])
    sched.submit(again.job)
    _wait([again])
    assert again.tokens == want[2]  # the same seed repeats, whoever shares the batch


def test_a_cancelled_row_leaves_and_the_others_are_unchanged(model):
    sched = Scheduler(model)
    gone = Row(PROMPTS[1], 40)
    gone.then(3, gone.cancel.set)
    stays = [Row(PROMPTS[0], 20), Row(PROMPTS[3], 20)]
    for r in [gone, *stays]:
        sched.submit(r.job)
    _wait([gone, *stays])
    assert len(gone.tokens) <= 4 and sched.cancelled == 1
    assert [r.tokens for r in stays] == [_alone(model, PROMPTS[0], 20), _alone(model, PROMPTS[3], 20)]
    queued = Row(PROMPTS[2], 5)
    queued.cancel.set()  # cancelled before it ran: never prefilled
    sched.submit(queued.job)
    _wait([queued])
    assert queued.tokens == [] and sched.cancelled == 2


def test_eos_ends_a_row_and_max_batch_bounds_the_batch(model):
    ref = _alone(model, PROMPTS[1], 12)
    eos = ref[4]  # the fifth greedy token of this prompt plays EOS
    sched = Scheduler(model, max_batch=2)
    rows = [Row(p, 12, eos=eos) for p in PROMPTS]
    for r in rows:
        sched.submit(r.job)
    _wait(rows)
    assert [r.tokens for r in rows] == [_alone(model, p, 12, eos=eos) for p in PROMPTS]
    assert rows[1].tokens == ref[: ref.index(eos) + 1]
    assert sched.widest == 2


def test_a_failing_row_fails_its_batch_and_the_scheduler_keeps_serving(model):
    sched = Scheduler(model)
    bad = Row(PROMPTS[0], 10)

    def boom() -> None:
        raise RuntimeError("callback failed")

    bad.then(2, boom)
    sched.submit(bad.job)
    with pytest.raises(RuntimeError, match="callback failed"):
        bad.job.done.result(timeout=60)
    good = Row(PROMPTS[2], 6)
    sched.submit(good.job)
    _wait([good])
    assert good.tokens == _alone(model, PROMPTS[2], 6) and sched.active == 0


def test_batch_dependent_rope_runs_one_request_at_a_time(model):
    """Dynamic NTK computes its base from the batch's largest position: such a model is not batched,
    and its requests still give generate's tokens."""
    import paddle

    from bmtrain_cli.models import build

    paddle.seed(3)
    dyn = build(replace(TINY, vocab_size=300, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    assert batchable(model) and not batchable(dyn)
    sched = Scheduler(dyn)
    rows = [Row(p, 6) for p in PROMPTS[:2]]
    for r in rows:
        sched.submit(r.job)
    _wait(rows)
    assert [r.tokens for r in rows] == [_alone(dyn, p, 6) for p in PROMPTS[:2]]
    assert sched.steps == 0
