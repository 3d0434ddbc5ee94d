"""ERNIE 4.5 MoE (``model_type: ernie4_5_moe``, ERNIE-4.5-21B-A3B and friends): ERNIE 4.5 attention
(interleaved rope, use_bias) with routed experts between ``moe_layer_start_index`` and
``moe_layer_end_index`` every ``moe_layer_interval`` layers, always-on shared experts, and top-k picked on
the routing probabilities plus ``e_score_correction_bias`` (weights from the unbiased probabilities,
renormalised with ``moe_norm_min``)."""

from typing import Any, Dict, Mapping

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    bias = bool(cfg.get("use_bias", False))
    if bias:  # transformers' Ernie4_5_MoeForCausalLM then biases the LM head too, which is not supported here
        raise UserError("ernie4_5_moe with use_bias=true (a biased LM head) is not supported")
    layers = int(cfg["num_hidden_layers"])
    end = int(cfg.get("moe_layer_end_index", -1))
    return {
        "attention_bias": bias,
        "mlp_bias": bias,
        "num_experts": int(cfg.get("moe_num_experts", cfg.get("num_experts", 64))),
        "num_experts_per_tok": int(cfg.get("moe_k", cfg.get("num_experts_per_tok", 6))),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 1536)),
        "moe_shared_experts": int(cfg.get("moe_num_shared_experts", 2)),
        "moe_layer_start": int(cfg.get("moe_layer_start_index", 1)),
        "moe_layer_end": layers - 1 if end == -1 else end,
        "decoder_sparse_step": int(cfg.get("moe_layer_interval", 1)),
        "moe_norm_min": float(cfg.get("moe_norm_min", 1e-12)),
        "output_router_logits": bool(cfg.get("output_router_logits", False)),
        "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.001)),
    }


def _write(arch: Any) -> Dict[str, Any]:
    return {
        "use_bias": arch.attention_bias,
        "moe_num_experts": arch.num_experts,
        "moe_k": arch.num_experts_per_tok,
        "moe_intermediate_size": arch.moe_intermediate_size,
        "moe_num_shared_experts": arch.moe_shared_experts,
        "moe_layer_start_index": arch.moe_layer_start,
        "moe_layer_end_index": arch.num_hidden_layers - 1
        if arch.moe_layer_end is None
        else arch.moe_layer_end,
        "moe_layer_interval": arch.decoder_sparse_step,
        "moe_norm_min": arch.moe_norm_min,
        "output_router_logits": arch.output_router_logits,
        "router_aux_loss_coef": arch.router_aux_loss_coef,
    }


FAMILY = Family(
    name="ernie4_5_moe",
    model_types=("ernie4_5_moe",),
    hf_architecture="Ernie4_5_MoeForCausalLM",
    description="ERNIE 4.5 MoE: ERNIE attention, routed + shared experts, score-bias top-k",
    defaults={
        "rope_interleaved": True,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_shared_experts": 1,
        "moe_layer_start": 1,
        "moe_score_bias": True,
        "moe_norm_min": 1e-12,
    },
    known_keys=(
        "use_bias",
        "moe_num_experts",
        "num_experts",
        "moe_k",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "moe_num_shared_experts",
        "moe_layer_start_index",
        "moe_layer_end_index",
        "moe_layer_interval",
        "moe_norm_min",
        "output_router_logits",
        "router_aux_loss_coef",
    ),
    read_hf=_read,
    moe=True,
    write_hf=_write,
    free_head_dim=True,
    # the hub's name of the score bias; transformers 5.x keeps it inside the router
    hf_renames=((".mlp.gate.moe_statics.", ".mlp.moe_statics."),),
    score_bias_row=True,
)
