"""Gemma 2 (``model_type: gemma2``): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after
attention and MLP, scores scaled by query_pre_attn_scalar and soft-capped (attn_logit_softcapping),
logits soft-capped (final_logit_softcapping), sliding-window and global layers alternating (one rope
base), GeGLU (tanh), tied embeddings. No q/k norms (Gemma 3 adds them)."""

from typing import Any, Dict, Mapping, Optional

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family
from bmtrain_cli.models.families.gemma3_text import FAMILY as GEMMA3

_PATTERN = 2  # transformers' rule without layer_types: even layers slide, odd layers are global
_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _cap(cfg: Mapping[str, Any], key: str) -> Optional[float]:
    value = cfg.get(key, 50.0 if key == "attn_logit_softcapping" else 30.0)  # transformers' defaults
    if value is not None and float(value) <= 0:
        raise UserError(f"config.json: {key}={value} must be positive (or null for no soft-capping)")
    return None if value is None else float(value)


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise UserError("config.json: use_bidirectional_attention=true is not supported (causal models only)")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % _PATTERN else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise UserError(f"config.json: layer_types {types} are not {n} of sliding_attention/full_attention")
    return {
        "layer_types": tuple(types),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        **{key: _cap(cfg, key) for key in _CAPS},
    }


def _write(arch: Any) -> Dict[str, Any]:
    """Gemma 3's keys without its second rope base, with the caps."""
    out = {k: v for k, v in GEMMA3.write_hf(arch).items() if k != "rope_local_base_freq"}
    return {**out, **{key: getattr(arch, key) for key in _CAPS}}


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    hf_architecture="Gemma2ForCausalLM",
    description="Gemma 2: scaled embeddings, (1+w) sandwich norms, soft-capped scores and logits, "
    "alternating sliding/global layers",
    defaults={
        "norm_offset": True,
        "scale_embeddings": True,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256.0,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    # Gemma 3's keys but its layer pattern and second rope base
    known_keys=tuple(k for k in GEMMA3.known_keys if "pattern" not in k and k != "rope_local_base_freq"),
    read_hf=_read,
    sliding_window=True,
    write_hf=_write,
    free_head_dim=True,
    sliding_pattern=_PATTERN,
    norm_names=GEMMA3.norm_names,  # (1 + w) norms before and after attention and MLP
)
