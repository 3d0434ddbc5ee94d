"""The record every family module fills in (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple


def _no_extra_keys(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {}


def _nothing_to_write(arch: Any) -> Dict[str, Any]:
    return {}


_PRE_NORMS = {"pre_attn": "input_layernorm", "pre_mlp": "post_attention_layernorm"}
NORM_ROLES = ("pre_attn", "post_attn", "pre_mlp", "post_mlp")


@dataclass(frozen=True)
class Family:
    """One model family. ``read_hf(config_json) -> {ModelArch field: value}`` reads what only this family
    has; ``write_hf(arch) -> {config.json key: value}`` writes it back (transformers 4.x and 5.x names)."""

    name: str
    model_types: Tuple[str, ...]
    hf_architecture: str
    description: str
    defaults: Dict[str, Any] = field(default_factory=dict)
    known_keys: Tuple[str, ...] = ()  # config.json keys read by read_hf (not kept as unknown extras)
    read_hf: Callable[[Mapping[str, Any]], Dict[str, Any]] = _no_extra_keys
    write_hf: Callable[[Any], Dict[str, Any]] = _nothing_to_write
    # Hugging Face puts ``attention_bias`` on o_proj too (LLaMA, Qwen3) or only on q/k/v (Qwen2)
    o_proj_bias: bool = True
    positions: Tuple[str, ...] = ("rope",)  # position encodings the family's checkpoints use
    # head_dim is its own setting (Qwen3), not hidden_size / num_attention_heads
    free_head_dim: bool = False
    # the decoder layer's RMSNorms by role, named as Hugging Face names them: pre_attn and pre_mlp in every
    # family; post_attn and post_mlp (norms of the attention and MLP outputs) where the family has them
    norm_names: Mapping[str, str] = field(default_factory=lambda: dict(_PRE_NORMS))
    qkv_name: str = "W_pack"  # the fused q/k/v projection where ``fused_qkv`` is set (Phi-3: qkv_proj)
    sliding_window: bool = False  # its checkpoints may set a local attention window
    # with sliding_window and no layer_types: every sliding_pattern-th layer is global (Gemma 3: 6)
    sliding_pattern: Optional[int] = None
    # (our parameter-name fragment, the checkpoint's), applied in order when reading and reversed when
    # writing (Mixtral's block_sparse_moe / w1 w2 w3)
    hf_renames: Tuple[Tuple[str, str], ...] = ()
    moe: bool = False  # its checkpoints may have a mixture of experts (num_experts > 0)
    # how the router scores experts: "softmax" over them, or "sigmoid" each (GLM-4.5, DeepSeek-V3: the
    # top-k weights are the sigmoid scores, renormalised with norm_topk_prob)
    moe_scoring: str = "softmax"
    score_bias_row: bool = False  # its checkpoints hold e_score_correction_bias as [1, experts] (ERNIE)

    def default(self, key: str, fallback: Any) -> Any:
        return self.defaults.get(key, fallback)


def rope_parameter(cfg: Mapping[str, Any], key: str, default: float) -> float:
    """A rope setting transformers 4.x keeps at the top level of config.json and 5.x in rope_parameters."""
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get(key, params.get(key, default)))
