"""Learning-rate schedules: linear warmup, then cosine decay to min_lr (default), linear decay, or constant.

The schedule is a pure function of the optimizer step, so resuming needs only the step number. The peak
learning rate comes from ``config.derived`` (after the optional linear scaling rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict

from bmtrain_cli.config.derived import schedule_problems
from bmtrain_cli.errors import UserError


@dataclass(frozen=True)
class Schedule:
    """lr(step) for step = 0, 1, ..., total_steps - 1 (the lr used by the step-th optimizer update)."""

    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"  # cosine | linear | constant
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("cosine", "linear", "constant"):
            raise ValueError(f"unknown lr_scheduler {self.kind!r}")
        if self.total_steps <= 0:
            raise ValueError("total_steps must be > 0")

    def __call__(self, step: int) -> float:
        if self.warmup_steps > 0 and step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.peak_lr
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / decay_steps))
        if self.kind == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.peak_lr - self.min_lr) * factor

    def state_dict(self) -> Dict[str, Any]:
        return {
            "peak_lr": self.peak_lr,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "kind": self.kind,
            "min_lr": self.min_lr,
        }


def warmup_steps_for(warmup_steps: int, warmup_ratio: float, total_steps: int) -> int:
    """Warmup length from either form (the config allows only one of them)."""
    if warmup_steps:
        return min(warmup_steps, max(0, total_steps - 1))
    return int(math.ceil(warmup_ratio * total_steps)) if warmup_ratio else 0


def build_schedule(train_cfg: Any, peak_lr: float, total_steps: int) -> Schedule:
    """Schedule of a train_config section; ``peak_lr`` is derived.learning_rate (linear scaling applied)."""
    for message in schedule_problems(train_cfg.min_lr, peak_lr, train_cfg.lr_scheduler):
        raise UserError(f"train_config.min_lr: {message}")
    min_lr = train_cfg.min_lr if train_cfg.lr_scheduler != "constant" else peak_lr
    return Schedule(
        peak_lr=peak_lr,
        total_steps=total_steps,
        warmup_steps=warmup_steps_for(train_cfg.warmup_steps, train_cfg.warmup_ratio, total_steps),
        kind=train_cfg.lr_scheduler,
        min_lr=min_lr,
    )
