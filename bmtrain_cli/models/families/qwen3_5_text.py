"""Qwen3.5 dense (``model_type: qwen3_5_text``, the language model of Qwen3.5): hybrid layers, three
Gated DeltaNet linear-attention layers (models/linear_attention.py: a causal depthwise convolution over
[q; k; v], l2-normed q/k, the gated delta rule, a gated RMSNorm on the output) to one full-attention layer
whose q_proj also yields a sigmoid gate of its output, with q/k norms and rope on a quarter of each head;
(1 + w) RMSNorms."""

from typing import Any, Dict, Mapping

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family, rope_parameter
from bmtrain_cli.models.families._linear import LinearAttention

_KINDS = {"linear_attention", "full_attention"}
_FRESH = LinearAttention(16, 32, 128, 128, 4)  # transformers' defaults (a fresh model, missing keys)
# config.json key -> LinearAttention field
_LINEAR_KEYS = {
    "linear_num_key_heads": "num_key_heads",
    "linear_num_value_heads": "num_value_heads",
    "linear_key_head_dim": "key_head_dim",
    "linear_value_head_dim": "value_head_dim",
    "linear_conv_kernel_dim": "conv_kernel",
}


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - _KINDS:
        raise UserError(f"config.json: layer_types {types} are not {n} of linear_attention/full_attention")
    shape = LinearAttention(**{f: int(cfg.get(key, getattr(_FRESH, f))) for key, f in _LINEAR_KEYS.items()})
    if shape.num_value_heads % shape.num_key_heads:
        raise UserError(
            f"config.json: linear_num_value_heads ({shape.num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({shape.num_key_heads})"
        )
    return {
        "layer_types": tuple(types),
        "linear_attention": shape,
        "attn_output_gate": True,
        "partial_rotary_factor": rope_parameter(cfg, "partial_rotary_factor", 0.25),
    }


def _write(arch: Any) -> Dict[str, Any]:
    out = {key: getattr(arch.linear_attention, f) for key, f in _LINEAR_KEYS.items()}
    out["layer_types"] = [arch.layer_type(i) for i in range(arch.num_hidden_layers)]
    out["partial_rotary_factor"] = arch.partial_rotary_factor
    out["attention_bias"] = arch.attention_bias
    return out


_DEFAULTS: Dict[str, Any] = dict(norm_offset=True, qk_norm=True, attn_output_gate=True, head_dim=256)
_DEFAULTS.update(partial_rotary_factor=0.25, rope_theta=10000000.0, linear_attention=_FRESH)

FAMILY = Family(
    name="qwen3_5_text",
    model_types=("qwen3_5_text",),
    hf_architecture="Qwen3_5ForCausalLM",
    known_keys=("layer_types", "full_attention_interval", "partial_rotary_factor", *_LINEAR_KEYS),
    description="Qwen3.5 (dense): Gated DeltaNet linear attention + gated full attention, partial rope",
    defaults=_DEFAULTS,
    read_hf=_read,
    write_hf=_write,
    free_head_dim=True,
)
