"""models/decoding.py, the one next-token step of every decoding loop: the tokens it gives are pinned
(tests/fixtures/decoding_pins.json, written by tests/fixtures/make_decoding_pins.py), and the loops that
share it (KV-cached generate, GRPO's rollouts, generation over logits only) agree with each other."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.export.loading import InferenceModel, generate_static
from bmtrain_cli.models.decoding import DecodeStep, SamplingOptions
from bmtrain_cli.models.generate import generate
from tests.fixtures import make_decoding_pins as pins

FIXTURE = Path(pins.__file__).with_name("decoding_pins.json")


@pytest.fixture(scope="module")
def model():
    return pins.model()


def test_decoding_gives_the_pinned_tokens_greedy_sampled_and_in_grpo_rollouts():
    """The same seed samples the same tokens as when the fixture was written (generate over several
    prompts, some stopping at EOS, and GRPO's rollout sampler over several seeded generate calls)."""
    want = json.loads(FIXTURE.read_text())
    got = pins.pins()
    assert want["prompts"] == pins.PROMPTS
    assert set(got) == set(want)
    for name in got:
        assert got[name] == want[name], name
    stopped = [c for c in want["sampled_top_p_eos"] + want["greedy_eos"] if len(c) < 12]
    assert stopped and all(c[-1] in (3, 31) for c in stopped)  # the EOS cases do stop early
    assert want["sampled"] != want["greedy"]


@pytest.mark.parametrize("options", [pins.CASES["greedy_eos"], pins.CASES["sampled_top_p_eos"]])
def test_logits_only_generation_equals_the_cached_loop(model, options):
    """generate_static (a paddle-inference export: each prompt alone, the whole sequence recomputed per
    token) picks the tokens the KV-cached, batched loop picks, sampled ones included."""
    static = InferenceModel(path=Path("."), format="checkpoint", tokenizer=None, model=model)
    assert generate_static(static, pins.PROMPTS, options) == generate(model, pins.PROMPTS, options)


def test_a_rows_samples_do_not_depend_on_the_order_rows_are_decoded_in():
    source = np.random.default_rng(1)
    logits = [source.standard_normal((3, 40)).astype(np.float32) for _ in range(5)]
    options = SamplingOptions(max_new_tokens=5, temperature=1.0, top_p=0.9, seed=4)
    together = DecodeStep(options, 3)
    for step in logits:
        together(step, [0, 1, 2])
    apart = DecodeStep(options, 3)
    for row in (2, 0, 1):  # row by row, the rows' tokens in a different order
        for step in logits:
            apart(step[row : row + 1], [row])
    assert apart.tokens == together.tokens and together.done.all()
    assert len({tuple(t) for t in together.tokens}) == 3


def test_a_row_stops_at_eos_at_max_new_tokens_or_when_the_callback_says():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[:, 7] = 1.0  # greedy: token 7 every time
    seen = []

    def on_token(row: int, token: int) -> bool:
        seen.append((row, token))
        return row == 2

    step = DecodeStep(SamplingOptions(max_new_tokens=2), 3, on_token)
    step(logits, [0, 1, 2])
    assert step.done.tolist() == [False, False, True] and seen == [(0, 7), (1, 7), (2, 7)]
    step(logits[:2], [0, 1])
    assert step.done.all() and step.tokens == [[7, 7], [7, 7], [7]]
    eos = DecodeStep(SamplingOptions(max_new_tokens=9, eos_token_id=7), 1)
    eos(logits[:1], [0])
    assert eos.done[0] and eos.tokens == [[7]]
