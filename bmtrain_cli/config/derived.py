"""Values derived from a config (never written back into it): batch arithmetic, world size, lr."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

LR_SCALING_BASE_BATCH = 256


def peak_learning_rate(learning_rate: float, scale_lr: bool, global_batch: int) -> float:
    """The learning rate the schedule peaks at: ``learning_rate``, or with the linear scaling rule
    ``learning_rate x global_batch / 256``."""
    return learning_rate * global_batch / LR_SCALING_BASE_BATCH if scale_lr else learning_rate


def schedule_problems(min_lr: float, peak_lr: float, lr_scheduler: str) -> List[str]:
    """What the learning-rate schedule refuses (validate-config reports the same before a run)."""
    if lr_scheduler != "constant" and min_lr > peak_lr:
        return [
            f"min_lr ({min_lr:g}) exceeds the peak learning_rate ({peak_lr:g}): the {lr_scheduler} schedule "
            "cannot decay from the peak to a higher floor"
        ]
    return []


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_ranks: int  # ranks that see different data: data_parallel x sharding_parallel
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    learning_rate: float  # after the optional linear scaling rule
    tokens_per_step: int  # upper bound: global batch x max_seq_len


def derive(config: Any) -> Derived:
    """Derived values of a ``config.schema.Config`` (``Config.derived()``); assumes check_config has accepted
    the config (batch sizes divide)."""
    par, tr = config.parallel, config.train
    data_ranks = par.data_ranks
    per_pass = tr.micro_batch_size * data_ranks
    global_batch = tr.global_batch_size or per_pass
    accum = max(1, global_batch // per_pass)
    lr = peak_learning_rate(tr.learning_rate, tr.scale_lr, global_batch)
    return Derived(
        world_size=par.world_size,
        data_ranks=data_ranks,
        micro_batch_size=tr.micro_batch_size,
        global_batch_size=global_batch,
        grad_accum_steps=accum,
        learning_rate=lr,
        tokens_per_step=global_batch * config.model.max_seq_len,
    )
