"""DataParallel: a model's parameters broadcast from the group's first rank; gradients summed by train_step."""

from __future__ import annotations

from typing import Any, Optional

from bmtrain_cli.api.common import broadcast_parameters
from bmtrain_cli.api.distributed import context
from bmtrain_cli.errors import UserError


def DataParallel(model: Any, group_size: Optional[int] = None, sharding_stage: Optional[int] = None) -> Any:
    """Replicate ``model`` over the data ranks: parameters broadcast from the group's first rank;
    train_step sums the gradients over the group. ``group_size`` (checked) is the number of data ranks,
    data_parallel x sharding_parallel of init_distributed. ``sharding_stage=1`` asserts that the
    optimizer state is split over sharding_parallel ranks (fleet's sharding optimizer); stages 2/3 are
    available through ``bmtrain train`` (parallel_config.sharding_stage) only."""
    ctx = context("DataParallel")
    assert ctx.config is not None  # init_distributed's context holds its layout as a config
    par = ctx.config.parallel
    if group_size is not None and group_size != ctx.data_world:
        raise UserError(
            f"DataParallel(group_size={group_size}) but init_distributed set up {ctx.data_world} data "
            f"rank(s) (data_parallel {par.data_parallel} x sharding_parallel {par.sharding_parallel})"
        )
    if sharding_stage is not None:
        if sharding_stage not in (1, 2, 3):
            raise UserError(f"DataParallel: sharding_stage must be 1, 2 or 3, got {sharding_stage!r}")
        if sharding_stage != 1:
            raise UserError(
                f"DataParallel: sharding_stage {sharding_stage} wraps the model and optimizer together and is "
                "available through `bmtrain train` (parallel_config.sharding_stage) only; use 1 here"
            )
        if par.sharding_parallel == 1:
            raise UserError(
                "DataParallel(sharding_stage=1) needs init_distributed(sharding_parallel=N) with N > 1"
            )
    for group in ctx.data_groups():
        broadcast_parameters(model, group)
    return model
