"""validate-config checks of the model_config keys named after a config.json key of some families only
(DeepSeek-V3's latent attention sizes, the sigmoid group-limited router's settings, norm_topk_prob): each
is accepted where the family writes that key to config.json, and the sizes must make a model the family's
own config.json reader accepts (the experts split into the groups, the kept groups hold the top k)."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.arch import (
    FAMILY_SPECIFIC_KEYS,
    MODEL_CONFIG_RENAMES,
    arch_from_hf_dict,
    arch_to_hf_dict,
)

FAMILY_KEYS = (*FAMILY_SPECIFIC_KEYS, *MODEL_CONFIG_RENAMES)


def check_family_keys(model: Any, arch: Any, err: Callable[..., None]) -> None:
    if arch is None:
        return
    given = [k for k in FAMILY_KEYS if getattr(model, k, None) is not None]
    if not given:
        return
    written = arch_to_hf_dict(arch)
    foreign = [k for k in given if k not in written]
    for key in foreign:
        owners = "deepseek_v3" if "lora_rank" in key or "head_dim" in key else "glm4_moe, deepseek_v3"
        err(
            f"model_config.{key}",
            f"{arch.family} has no {key} (a {owners} setting)",
            f"remove it, or set model_config.family to one of {owners}",
        )
    if foreign:
        return
    try:  # the family's own reader refuses what it cannot build
        arch_from_hf_dict(written, source="model_config")
    except UserError as exc:
        err(f"model_config.{given[0]}", str(exc), "change the sizes so that the family accepts them")
