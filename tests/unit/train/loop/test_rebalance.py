"""The pieces of dynamic pipeline load balancing that need no second process: which parameters change
stage, the slowest/fastest ratio, the per-item forward timer; the multi-process run is
tests/integration/test_pipeline_rebalance.py."""

from __future__ import annotations

import time

import paddle

from bmtrain_cli.parallel.pipeline import partition
from bmtrain_cli.train.loop.pipeline_rebalance import StageMonitor, slowest_over_fastest, stages_of, transfers

# items: embedding (tied with the head), 4 decoder layers, norm, head
NAMES = [["embed.weight"], ["l0.w"], ["l1.w"], ["l2.w"], ["l3.w"], ["norm.w"], ["embed.weight"]]


def test_moved_parameters_go_from_their_old_stage_to_their_new_one():
    old, new = [0, 3, 7], [0, 5, 7]
    assert stages_of(NAMES, old)["embed.weight"] == {0, 1}  # the tied weight is on both ends
    assert transfers(NAMES, old, new) == [("l2.w", 1, 0), ("l3.w", 1, 0)]
    assert transfers(NAMES, new, old) == [("l2.w", 0, 1), ("l3.w", 0, 1)]
    assert transfers(NAMES, old, old) == []
    # three stages: a layer passing from stage 2 to stage 1, another from 1 to 0
    assert transfers(NAMES, [0, 2, 4, 7], [0, 3, 5, 7]) == [("l1.w", 1, 0), ("l3.w", 2, 1)]


def test_the_partition_of_measured_costs_isolates_a_slow_layer():
    costs = [0.001, 0.01, 0.01, 0.01, 0.2, 0.001, 0.002]
    old = [0, 3, 7]
    assert slowest_over_fastest(costs, old) > 10
    new = partition(costs, 2)
    assert new == [0, 4, 7]  # the slow layer alone with the norm and head
    assert slowest_over_fastest(costs, new) < slowest_over_fastest(costs, old)


class _Sleepy(paddle.nn.Layer):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return x


class _Stage:
    """What StageMonitor reads of fleet's PipelineLayer: the stage's items in order."""

    def __init__(self, items):
        self.run_function = items


def test_the_monitor_times_each_training_forward_of_its_items():
    fast, slow = _Sleepy(0.0), _Sleepy(0.02)
    monitor = StageMonitor(_Stage([fast, slow]), first_item=3, synchronize=False)
    x = paddle.ones([2])
    for _ in range(3):  # three steps of two micro-batches: the first forward of each step is timed
        slow(fast(x))
        slow(fast(x))
        monitor.next_step()
    slow.eval()
    slow(x)  # an eval forward is not counted
    seconds = monitor.seconds
    assert sorted(seconds) == [3, 4] and len(seconds[3]) == 3 and len(seconds[4]) == 3
    medians = monitor.take()
    assert medians[4] >= 0.02 > medians[3]
    assert monitor.take() == {}  # the window starts again
