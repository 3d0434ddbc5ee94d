"""Mistral: LLaMA with a sliding attention window."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {"sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None}


FAMILY = Family(
    name="mistral",
    model_types=("mistral",),
    hf_architecture="MistralForCausalLM",
    description="Mistral: LLaMA with local attention (sliding_window)",
    known_keys=("sliding_window",),
    read_hf=_read,
    sliding_window=True,
    write_hf=lambda arch: {"sliding_window": arch.sliding_window},
)
