"""GLM-4.5 / GLM-4.6 (``model_type: glm4_moe``): LLaMA-style layers with q/k/v biases, optional per-head q/k
norms and half-split rope on the first ``partial_rotary_factor`` of each head; the first
``first_k_dense_replace`` layers dense, the rest a mixture of experts with a sigmoid router: the top-k picked
on the scores plus ``e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` expert groups,
weighted by the unbiased scores (renormalised with ``norm_topk_prob``) times ``routed_scaling_factor``,
beside ``n_shared_experts`` always-on experts. The multi-token-prediction layers of the published
checkpoints (layers past ``num_hidden_layers``) are not part of the model and are skipped on load."""

from typing import Any, Dict, Mapping

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family, rope_parameter


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 128)))
    top_k = int(cfg.get("num_experts_per_tok", 8))
    groups, topk_groups = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if experts % groups or not 0 < topk_groups <= groups or topk_groups * (experts // groups) < top_k:
        raise UserError(
            f"glm4_moe: n_routed_experts ({experts}) must split into n_group ({groups}) equal groups and the "
            f"topk_group ({topk_groups}) best groups must hold num_experts_per_tok ({top_k}) experts"
        )
    return {
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "partial_rotary_factor": rope_parameter(cfg, "partial_rotary_factor", 0.5),
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size", 1408)),
        "moe_shared_experts": int(cfg.get("n_shared_experts", 1)),
        "moe_layer_start": int(cfg.get("first_k_dense_replace", 1)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "moe_groups": groups,
        "moe_topk_groups": topk_groups,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "output_router_logits": bool(cfg.get("output_router_logits", False)),
    }


# config.json key -> ModelArch field, as transformers' Glm4MoeConfig names them
_WRITTEN = (
    ("attention_bias", "attention_bias"),
    ("use_qk_norm", "qk_norm"),
    ("partial_rotary_factor", "partial_rotary_factor"),
    ("n_routed_experts", "num_experts"),
    ("num_experts_per_tok", "num_experts_per_tok"),
    ("moe_intermediate_size", "moe_intermediate_size"),
    ("n_shared_experts", "moe_shared_experts"),
    ("first_k_dense_replace", "moe_layer_start"),
    ("norm_topk_prob", "norm_topk_prob"),
    ("n_group", "moe_groups"),
    ("topk_group", "moe_topk_groups"),
    ("routed_scaling_factor", "routed_scaling_factor"),
    ("output_router_logits", "output_router_logits"),
)


def _write(arch: Any) -> Dict[str, Any]:
    return {key: getattr(arch, name) for key, name in _WRITTEN}


FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    hf_architecture="Glm4MoeForCausalLM",
    description="GLM-4.5: q/k/v biases, partial rope, sigmoid group-limited routing, shared experts",
    o_proj_bias=False,  # q/k/v biases only
    free_head_dim=True,
    defaults={
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_shared_experts": 1,
        "moe_layer_start": 1,
        "moe_score_bias": True,
    },
    known_keys=(*(key for key, _ in _WRITTEN), "num_local_experts", "router_aux_loss_coef"),
    read_hf=_read,
    write_hf=_write,
    moe=True,
    moe_scoring="sigmoid",
    # transformers keeps the score bias in the router (``mlp.gate.e_score_correction_bias``)
    hf_renames=((".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),),
)
