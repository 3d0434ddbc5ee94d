"""DeepSeek-V3 (``model_type: deepseek_v3``; Kimi-K2's ``kimi_k2`` configs are the same architecture at
other sizes): multi-head latent attention and GLM-4.5's router (glm4_moe.py), the first
``first_k_dense_replace`` layers dense.

Multi-head latent attention (models/blocks.py ``LatentAttention``): the query comes from ``q_proj``, or
with ``q_lora_rank`` through ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; ``kv_a_proj_with_mqa``
gives the ``kv_lora_rank`` latent and one rope key of ``qk_rope_head_dim`` shared by every head;
``kv_a_layernorm`` then ``kv_b_proj`` expand the latent into each head's key part ``qk_nope_head_dim`` and
value ``v_head_dim``. Rope (interleaved pairs with ``rope_interleave``, else halves) turns only the
rope parts; scores scale by (qk_nope_head_dim + qk_rope_head_dim)^-1/2, times YaRN's mscale(mscale_all_dim)
squared under yarn. ``ModelArch.head_dim`` is the rope part (transformers' ``head_dim`` too). The
multi-token-prediction layer of the published checkpoints (past ``num_hidden_layers``) is skipped on load.
"""

from typing import Any, Dict, Mapping, Tuple

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family
from bmtrain_cli.models.families.glm4_moe import ROUTER_FAMILY, ROUTER_KNOWN_KEYS, read_router, write_router

# transformers' DeepseekV3Config defaults where they differ from GLM-4.5's router
_ROUTER_DEFAULTS = {
    "n_routed_experts": 256,
    "moe_intermediate_size": 2048,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
}
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# the MLA projections beside o_proj (and q_proj where q_lora_rank is 0): LoRA targets, transformers' names
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def _refuse(source: str, what: str) -> None:
    raise UserError(f"deepseek_v3: {what} is not supported ({source})")


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    if cfg.get("quantization_config"):
        _refuse("quantization_config", "a quantised (FP8) checkpoint; convert it to bf16 first")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        _refuse("scoring_func/topk_method", "a router other than sigmoid with noaux_tc")
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        _refuse("moe_layer_freq", "experts in only some layers past first_k_dense_replace")
    heads = int(cfg["num_attention_heads"])
    if int(cfg.get("num_key_value_heads") or heads) != heads:
        _refuse(
            "num_key_value_heads", "fewer key/value heads than attention heads (kv_b_proj makes one each)"
        )
    return {
        **read_router(cfg, "deepseek_v3", _ROUTER_DEFAULTS),
        "q_lora_rank": int(cfg.get("q_lora_rank", 1536) or 0),
        "kv_lora_rank": int(cfg.get("kv_lora_rank", 512)),
        "qk_nope_head_dim": int(cfg.get("qk_nope_head_dim", 128)),
        "head_dim": int(cfg.get("qk_rope_head_dim", 64)),
        "v_head_dim": int(cfg.get("v_head_dim") or 128),
        "rope_interleaved": bool(cfg.get("rope_interleave", True)),
    }


def _write(arch: Any) -> Dict[str, Any]:
    return {
        **write_router(arch),
        "q_lora_rank": arch.q_lora_rank or None,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_nope_head_dim": arch.qk_nope_head_dim,
        "qk_rope_head_dim": arch.head_dim,
        "v_head_dim": arch.v_head_dim,
        "rope_interleave": arch.rope_interleaved,
        "attention_bias": arch.attention_bias,
    }


def mla_projections(arch: Any) -> Tuple[str, ...]:
    """The attention projections of a latent-attention layer."""
    q = ("q_a_proj", "q_b_proj") if arch.q_lora_rank else ("q_proj",)
    return (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def mla_shapes(arch: Any) -> Dict[str, Tuple[int, int]]:
    """(in, out) of each latent-attention projection (mla_projections says which a layer has)."""
    h, n, rq, rkv = arch.hidden_size, arch.num_attention_heads, arch.q_lora_rank, arch.kv_lora_rank
    qk = arch.qk_nope_head_dim + arch.head_dim
    return {
        "q_proj": (h, n * qk),
        "q_a_proj": (h, rq),
        "q_b_proj": (rq, n * qk),
        "kv_a_proj_with_mqa": (h, rkv + arch.head_dim),
        "kv_b_proj": (rkv, n * (arch.qk_nope_head_dim + arch.v_head_dim)),
        "o_proj": (n * arch.v_head_dim, arch.hidden_size),
    }


def mla_parameters(arch: Any) -> int:
    """Parameters of one latent-attention layer: its projections, their biases under attention_bias
    (q_a_proj, kv_a_proj_with_mqa, o_proj, as transformers has them) and the two latent norms."""
    shapes = mla_shapes(arch)
    names = mla_projections(arch)
    total = sum(i * o for name, (i, o) in shapes.items() if name in names)
    if arch.attention_bias:
        total += sum(shapes[n][1] for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj") if n in names)
    return total + arch.q_lora_rank + arch.kv_lora_rank


FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    hf_architecture="DeepseekV3ForCausalLM",
    description="DeepSeek-V3 / Kimi-K2: multi-head latent attention, sigmoid group-limited routing, shared experts",
    free_head_dim=True,
    defaults={
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_shared_experts": 1,
        "moe_layer_start": 1,
        "moe_score_bias": True,
        "routed_scaling_factor": 2.5,
        "rope_interleaved": True,
        "q_lora_rank": 96,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "head_dim": 16,
        "v_head_dim": 32,
    },
    known_keys=(
        *ROUTER_KNOWN_KEYS,
        *_MLA_KEYS,
        "qk_head_dim",  # transformers derives it (qk_nope_head_dim + qk_rope_head_dim)
        "rope_interleave",
        "scoring_func",
        "topk_method",
        "moe_layer_freq",
    ),
    read_hf=_read,
    write_hf=_write,
    **ROUTER_FAMILY,
)
