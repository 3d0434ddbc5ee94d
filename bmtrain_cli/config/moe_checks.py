"""validate-config checks of mixture-of-experts models (Qwen3-MoE, Mixtral): what this first slice runs.
The experts are plain per-expert layers on one device (models/moe.py): no tensor, pipeline or expert
parallelism, no static graph."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.config.refusals import refuse_model_parallel


def check_moe(config: Any, arch: Any, err: Callable[..., None]) -> None:
    if arch is None or not arch.num_experts:
        return
    p, t = config.parallel, config.train
    what = f"the {arch.family} mixture of experts"
    refuse_model_parallel(
        p,
        what,
        "no sharded experts, no expert parallelism",
        "use data_parallel and/or sharding_parallel",
        err,
    )
    if t.to_static:
        err(
            "train_config.to_static",
            f"{what} cannot run as a static graph: its dispatch reads the per-expert token counts",
            "set to_static: false",
        )
    if t.gradient_checkpointing and t.recompute_granularity == "full" and arch.output_router_logits:
        err(
            "train_config.recompute_granularity",
            "full recompute would leave the load-balancing loss (output_router_logits) without gradient",
            "use recompute_granularity: attention",
        )
