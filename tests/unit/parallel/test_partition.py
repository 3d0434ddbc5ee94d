"""Pipeline partition maths and micro-batch stacking (no processes)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.parallel.pipeline import (
    imbalance,
    partition,
    shifted_targets,
    stack_micro_batches,
    stage_costs,
    uniform_costs,
)


def _brute(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        worst = max(stage_costs(costs, b))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_partition_is_optimal(stages):
    rng = np.random.default_rng(stages)
    costs = list(rng.uniform(0.1, 5.0, size=9))
    b = partition(costs, stages)
    assert b[0] == 0 and b[-1] == len(costs) and len(b) == stages + 1
    assert all(b[i] < b[i + 1] for i in range(stages))
    assert max(stage_costs(costs, b)) == pytest.approx(_brute(costs, stages))


def test_uniform_gives_equal_layer_counts_and_reports_imbalance():
    costs = uniform_costs(8)
    b = partition(costs, 4)
    assert [c for c in stage_costs(costs, b)] == [2.0, 2.0, 2.0, 2.0]
    assert imbalance(costs, b) == pytest.approx(1.0)
    odd = uniform_costs(3)
    assert imbalance(odd, partition(odd, 2)) == pytest.approx(2 / 1.5)


def test_parameter_costs_move_layers_away_from_a_heavy_embedding():
    costs = [10.0] + [1.0] * 6 + [10.0]
    b = partition(costs, 2)
    assert stage_costs(costs, b) == [13.0, 13.0]


def test_too_many_stages_is_refused():
    with pytest.raises(ValueError):
        partition([1.0, 1.0], 3)


def test_shifted_targets_respect_segments():
    labels = np.array([[5, 6, 7, 8, 9, 10]])
    mask = np.array([[1, 1, 1, 2, 2, 0]])
    t = shifted_targets(labels, mask)
    assert t.tolist() == [[6, 7, IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX]]


def test_stack_pads_micro_batches_to_one_length():
    mb1 = {
        "input_ids": np.ones((2, 3), np.int64),
        "labels": np.ones((2, 3), np.int64),
        "attention_mask": np.ones((2, 3), np.int64),
        "position_ids": np.tile(np.arange(3), (2, 1)),
    }
    mb2 = {k: np.ones((2, 5), np.int64) for k in ("input_ids", "labels", "attention_mask")}
    out = stack_micro_batches([mb1, mb2])
    assert out["input_ids"].shape == (4, 5)
    assert out["attention_mask"][:2, 3:].sum() == 0
    assert (out["target"][:2, 2:] == IGNORE_INDEX).all()
    assert out["position_ids"][2].tolist() == [0, 1, 2, 3, 4]
