"""validate-config checks of expert parallel (parallel_config.expert_parallel > 1): what
parallel/expert_parallel.py runs today. Each refusal says why. Data, tensor and pipeline parallel compose
with it; what tensor and pipeline parallel need of an MoE model is checked by config/moe_checks.py."""

from __future__ import annotations

from typing import Any, Callable, Optional

from bmtrain_cli.methods import method_of

KEY = "parallel_config.expert_parallel"


def check_expert_parallel(config: Any, arch: Optional[Any], err: Callable[..., None]) -> None:
    p, t = config.parallel, config.train
    n = p.expert_parallel
    if n == 1:
        return
    if arch is not None and not arch.num_experts:
        err(
            KEY,
            f"expert_parallel needs a mixture-of-experts model; {arch.family} has no experts",
            "remove it",
        )
    elif arch is not None and arch.num_experts % n:
        err(
            KEY,
            f"the {arch.num_experts} experts of every MoE layer do not split evenly over expert_parallel {n} "
            "ranks",
            f"use a divisor of {arch.num_experts}",
        )
    if p.sharding_parallel > 1:
        err(
            "parallel_config.sharding_parallel",
            "expert parallel does not support sharding_parallel > 1 yet (the experts' gradients are reduced "
            "over their own replica group)",
            "use data_parallel",
        )
    if p.gradient_compression != "none":
        err(
            "parallel_config.gradient_compression",
            "expert parallel does not compress gradients yet (the experts' replica group is not the data group)",
            "set gradient_compression: none",
        )
    sample = method_of(t).sample
    if (
        sample == "pair"
        and t.finetuning == "lora"
        and method_of(t).reference(t)
        and not t.precompute_ref_log_probs
    ):
        err(
            "train_config.precompute_ref_log_probs",
            "expert parallel with LoRA scores the held-out pairs' reference (the policy with its adapters "
            "off) through the experts' dispatch, which each rank's own share of pairs would run out of step",
            "set precompute_ref_log_probs: true (every rank computes every pair once), or train full weights",
        )
