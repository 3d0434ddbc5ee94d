"""Learning-rate schedules."""

from __future__ import annotations

import math

import pytest

from bmtrain_cli.config.derived import derive
from bmtrain_cli.config.schema import Config, TrainConfig
from bmtrain_cli.train.optimizer.lr_schedule import Schedule, build_schedule, warmup_steps_for


def test_warmup_then_cosine_to_min_lr():
    s = Schedule(peak_lr=1.0, total_steps=110, warmup_steps=10, kind="cosine", min_lr=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(4) == pytest.approx(0.5)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert s(110) == pytest.approx(0.1)
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_linear_and_constant():
    lin = Schedule(peak_lr=2.0, total_steps=100, warmup_steps=0, kind="linear", min_lr=0.0)
    assert lin(0) == pytest.approx(2.0)
    assert lin(50) == pytest.approx(1.0)
    assert lin(100) == pytest.approx(0.0)
    const = Schedule(peak_lr=3.0, total_steps=10, warmup_steps=2, kind="constant")
    assert [const(i) for i in range(4)] == pytest.approx([1.5, 3.0, 3.0, 3.0])


def test_warmup_ratio_and_unknown_kind():
    assert warmup_steps_for(0, 0.1, 95) == 10
    assert warmup_steps_for(5, 0.0, 95) == 5
    with pytest.raises(ValueError):
        Schedule(peak_lr=1.0, total_steps=10, kind="exp")


def test_build_schedule_uses_linear_scaling_rule():
    cfg = Config.model_validate(
        {"train_config": {"learning_rate": 1e-3, "scale_lr": True, "micro_batch_size": 64, "max_steps": 10}}
    )
    lr = derive(cfg).learning_rate
    assert lr == pytest.approx(1e-3 * 64 / 256)
    s = build_schedule(cfg.train, lr, 10)
    assert max(s(i) for i in range(10)) == pytest.approx(lr)
    assert s(9) < lr and math.isfinite(s(9))


def test_min_lr_from_config():
    t = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_ratio=0.1, lr_scheduler="cosine")
    s = build_schedule(t, 1e-3, 100)
    assert s.warmup_steps == 10
    assert s(100) == pytest.approx(1e-4)
