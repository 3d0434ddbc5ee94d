"""Values derived from a config (never written back into it): batch arithmetic, world size, lr."""

from __future__ import annotations

from dataclasses import dataclass

from bmtrain_cli.config.schema import Config

LR_SCALING_BASE_BATCH = 256


@dataclass(frozen=True)
class Derived:
    world_size: int
    data_ranks: int  # ranks that see different data: data_parallel x sharding_parallel
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    learning_rate: float  # after the optional linear scaling rule
    tokens_per_step: int  # upper bound: global batch x max_seq_len


def derive(config: Config) -> Derived:
    """Derived values; assumes check_config has accepted the config (batch sizes divide)."""
    par, tr = config.parallel, config.train
    data_ranks = par.data_ranks
    per_pass = tr.micro_batch_size * data_ranks
    global_batch = tr.global_batch_size or per_pass
    accum = max(1, global_batch // per_pass)
    lr = tr.learning_rate * global_batch / LR_SCALING_BASE_BATCH if tr.scale_lr else tr.learning_rate
    return Derived(
        world_size=par.world_size,
        data_ranks=data_ranks,
        micro_batch_size=tr.micro_batch_size,
        global_batch_size=global_batch,
        grad_accum_steps=accum,
        learning_rate=lr,
        tokens_per_step=global_batch * config.model.max_seq_len,
    )
