"""Qwen3-MoE: Qwen3 attention (q/k norm, free head_dim) with a mixture of SwiGLU experts in the sparse
layers (``mlp.gate`` router, ``mlp.experts.{e}.gate_proj/up_proj/down_proj``); ``mlp_only_layers`` and
``decoder_sparse_step`` keep some layers dense."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family

MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
)


def read_moe(cfg: Mapping[str, Any], experts_key: str) -> Dict[str, Any]:
    """The mixture-of-experts settings of a config.json. The number of experts is ``experts_key``
    (the hub's name: num_experts for Qwen3-MoE, num_local_experts for Mixtral) or the other name
    (transformers 5.x writes num_local_experts for both)."""
    other = "num_local_experts" if experts_key == "num_experts" else "num_experts"
    return {
        "num_experts": int(cfg[experts_key] if cfg.get(experts_key) is not None else cfg[other]),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "output_router_logits": bool(cfg.get("output_router_logits", False)),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)),
    }


def write_moe(arch: Any, experts_key: str) -> Dict[str, Any]:
    return {
        experts_key: arch.num_experts,
        "num_experts_per_tok": arch.num_experts_per_tok,
        "output_router_logits": arch.output_router_logits,
        "router_aux_loss_coef": arch.router_aux_loss_coef,
    }


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        **read_moe(cfg, "num_experts"),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    }


def _write(arch: Any) -> Dict[str, Any]:
    return {
        "attention_bias": arch.attention_bias,
        **write_moe(arch, "num_experts"),
        "moe_intermediate_size": arch.moe_intermediate_size,
        "norm_topk_prob": arch.norm_topk_prob,
        "decoder_sparse_step": arch.decoder_sparse_step,
        "mlp_only_layers": list(arch.mlp_only_layers),
    }


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    description="Qwen3-MoE: Qwen3 attention, top-k routed SwiGLU experts, optional dense layers",
    defaults={
        "qk_norm": True,
        "rope_theta": 1000000.0,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    known_keys=(*MOE_KEYS, "decoder_sparse_step", "mlp_only_layers"),
    read_hf=_read,
    moe=True,
    write_hf=_write,
    free_head_dim=True,
)
