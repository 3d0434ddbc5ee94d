"""validate-config checks of mixture-of-experts models (Qwen3-MoE, Mixtral, ...): what runs today.
The experts are per-expert layers (models/moe.py), split between ranks by expert parallel
(config/expert_checks.py); pipeline parallel carries the load-balancing sums between stages to the last
stage's loss, SFT's tokens' or the preference pairs' (parallel/pipeline_moe.py); tensor parallel splits
the attention and the shared experts and keeps the router and the routed experts whole on every rank of
its group (each computes them alike); no static graph."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.models.moe import tensor_parallel_problem


def check_moe(config: Any, arch: Any, err: Callable[..., None]) -> None:
    if arch is None or not arch.num_experts:
        return
    p, t = config.parallel, config.train
    what = f"the {arch.family} mixture of experts"
    problem = tensor_parallel_problem(arch, p.tensor_parallel)
    if problem:
        err(
            "parallel_config.tensor_parallel",
            f"{what}: {problem}",
            "use a tensor_parallel degree that divides it",
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
