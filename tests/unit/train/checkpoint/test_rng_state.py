"""Generator states: the CPU generator is saved explicitly (paddle.get_rng_state() alone gives the current
device's), a JSON round trip restores the same draws, and CUDA states fit a different device count."""

from __future__ import annotations

import json
import random

import numpy as np
import paddle

from bmtrain_cli.train.checkpoint.rng_state import fitting_states, rng_state, set_rng_state


def _draws():
    return random.random(), float(np.random.rand()), paddle.rand([3]).numpy().tolist()


def test_round_trip_through_json_restores_the_same_draws():
    paddle.seed(123)
    random.seed(5)
    np.random.seed(7)
    _draws()
    saved = json.loads(json.dumps(rng_state()))
    assert saved["paddle"] and len(saved["paddle"]) == 1  # the CPU generator
    want = _draws()
    _draws()  # move every generator on
    assert set_rng_state(saved) == []
    assert _draws() == want


def test_cuda_states_fit_another_device_count():
    saved = ["s0", "s1", "s2", "s3"]
    assert fitting_states(saved, 4) == [(0, "s0"), (1, "s1"), (2, "s2"), (3, "s3")]
    assert fitting_states(saved, 2) == [(0, "s0"), (1, "s1")]  # fewer GPUs now
    assert fitting_states(saved[:1], 8) == [(0, "s0")]  # more GPUs now: the rest keep their seeds
    assert fitting_states(saved, 0) == []


def test_a_saved_cuda_state_is_ignored_on_a_cpu_build():
    paddle.seed(1)
    saved = rng_state()
    saved["paddle_cuda"] = saved["paddle"] * 2
    want = paddle.rand([2]).numpy().tolist()
    notes = set_rng_state(saved)
    assert paddle.rand([2]).numpy().tolist() == want
    assert notes == [] or not paddle.device.is_compiled_with_cuda()
