"""Gemma 3 (text; ``model_type: gemma3_text``, the 270M/1B checkpoints and the language model of the
others): embeddings scaled by sqrt(hidden), (1 + w) RMSNorms before and after attention and MLP, q/k
norms, scores scaled by query_pre_attn_scalar, interleaved sliding-window and global layers with their own
rope bases, GeGLU (tanh)."""

from typing import Any, Dict, Mapping

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family

_PATTERN = 6  # transformers' default: every sixth layer is global


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UserError(f"config.json: {key}={cfg[key]} (soft-capping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UserError("config.json: use_bidirectional_attention=true is not supported (causal models only)")
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", _PATTERN)))
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise UserError(f"config.json: layer_types {types} are not {n} of sliding_attention/full_attention")
    params = cfg.get("rope_parameters") or {}
    full, local = params.get("full_attention"), params.get("sliding_attention")
    out: Dict[str, Any] = {
        "layer_types": tuple(types),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "rope_local_theta": float(cfg.get("rope_local_base_freq", 10000.0)),
    }
    if isinstance(full, dict):  # transformers 5.x: rope parameters per layer type
        out["rope_theta"] = float(full.get("rope_theta", 1000000.0))
        kind = full.get("rope_type", full.get("type", "default"))
        out["rope_scaling"] = (
            None if kind == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
        )
    if isinstance(local, dict):
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise UserError("config.json: rope scaling on the sliding layers is not supported")
        out["rope_local_theta"] = float(local.get("rope_theta", 10000.0))
    return out


def _write(arch: Any) -> Dict[str, Any]:
    scalar = arch.query_pre_attn_scalar
    return {
        "hidden_activation": arch.hidden_act,
        "layer_types": [arch.layer_type(i) for i in range(arch.num_hidden_layers)],
        "sliding_window": arch.sliding_window,
        # transformers 5 types it int (Gemma 3's are 256, 168, ...)
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "rope_local_base_freq": arch.rope_local_theta,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": arch.attention_bias,
    }


FAMILY = Family(
    name="gemma3_text",
    model_types=("gemma3_text",),
    hf_architecture="Gemma3ForCausalLM",
    description="Gemma 3 (text): scaled embeddings, (1+w) sandwich norms, q/k norms, sliding/global layers",
    defaults={
        "norm_offset": True,
        "scale_embeddings": True,
        "qk_norm": True,
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rope_local_theta": 10000.0,
        "query_pre_attn_scalar": 256.0,
        "sliding_window": 4096,
    },
    known_keys=(
        "layer_types",
        "sliding_window",
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "query_pre_attn_scalar",
        "rope_local_base_freq",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
        "hidden_activation",
    ),
    read_hf=_read,
    sliding_window=True,
    write_hf=_write,
    free_head_dim=True,
    sliding_pattern=_PATTERN,
    norm_names={
        "pre_attn": "input_layernorm",
        "post_attn": "post_attention_layernorm",
        "pre_mlp": "pre_feedforward_layernorm",
        "post_mlp": "post_feedforward_layernorm",
    },
)
