"""Phi-3 / Phi-3.5 / Phi-4 (``model_type: phi3``): one qkv_proj and one gate_up_proj, LongRoPE scaling,
partial rotary (Phi-4-mini), an optional sliding window (Phi-3-mini)."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family, rope_parameter


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "partial_rotary_factor": rope_parameter(cfg, "partial_rotary_factor", 1.0),
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
    }
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # transformers 4.x keeps the pretraining length at the top level
        original = (
            scaling.get("original_max_position_embeddings")
            or cfg.get("original_max_position_embeddings")
            or 4096
        )
        keep = ("long_factor", "short_factor", "factor", "attention_factor")
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "original_max_position_embeddings": int(original),
            **{k: scaling[k] for k in keep if scaling.get(k) is not None},
        }
    return out


def _write(arch: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "partial_rotary_factor": arch.partial_rotary_factor,
        "sliding_window": arch.sliding_window,
    }
    if arch.rope_scaling and arch.rope_scaling.get("rope_type") == "longrope":
        out["original_max_position_embeddings"] = arch.rope_scaling["original_max_position_embeddings"]
    return out


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    hf_architecture="Phi3ForCausalLM",
    description="Phi-3/3.5/4: fused qkv_proj and gate_up_proj, LongRoPE, partial rotary",
    defaults={"fused_qkv": True, "fused_gate_up": True},
    known_keys=(
        "partial_rotary_factor",
        "sliding_window",
        "original_max_position_embeddings",
        "rope_scaling",
    ),
    read_hf=_read,
    sliding_window=True,
    write_hf=_write,
    qkv_name="qkv_proj",
    free_head_dim=True,
)
