"""GLM-4.5 / GLM-4.6 (``model_type: glm4_moe``): LLaMA-style layers with q/k/v biases, optional per-head q/k
norms and half-split rope on the first ``partial_rotary_factor`` of each head; the first
``first_k_dense_replace`` layers dense, the rest a mixture of experts with a sigmoid router: the top-k picked
on the scores plus ``e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` expert groups,
weighted by the unbiased scores (renormalised with ``norm_topk_prob``) times ``routed_scaling_factor``,
beside ``n_shared_experts`` always-on experts. The multi-token-prediction layers of the published
checkpoints (layers past ``num_hidden_layers``) are not part of the model and are skipped on load."""

from typing import Any, Dict, Mapping, Tuple

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families._base import Family, rope_parameter

# (config.json key, ModelArch field, GLM-4.5's default) of the sigmoid group-limited router; DeepSeek-V3
# (deepseek_v3.py) has the same router with other defaults
ROUTER_KEYS: Tuple[Tuple[str, str, Any], ...] = (
    ("n_routed_experts", "num_experts", 128),
    ("num_experts_per_tok", "num_experts_per_tok", 8),
    ("moe_intermediate_size", "moe_intermediate_size", 1408),
    ("n_shared_experts", "moe_shared_experts", 1),
    ("first_k_dense_replace", "moe_layer_start", 1),
    ("norm_topk_prob", "norm_topk_prob", True),
    ("n_group", "moe_groups", 1),
    ("topk_group", "moe_topk_groups", 1),
    ("routed_scaling_factor", "routed_scaling_factor", 1.0),
    ("output_router_logits", "output_router_logits", False),
)


def read_router(cfg: Mapping[str, Any], name: str, defaults: Mapping[str, Any]) -> Dict[str, Any]:
    """The router's ModelArch fields from a config.json (``defaults``: the family's defaults by key where
    they differ from GLM-4.5's); the experts must split into the groups and the kept groups hold the top-k."""
    given = dict(defaults)
    if cfg.get("num_local_experts") is not None:  # transformers' alias of n_routed_experts
        given["n_routed_experts"] = cfg["num_local_experts"]
    out: Dict[str, Any] = {}
    for key, field, default in ROUTER_KEYS:
        value = cfg.get(key)
        out[field] = type(default)(given.get(key, default) if value is None else value)
    experts, top_k = out["num_experts"], out["num_experts_per_tok"]
    groups, topk_groups = out["moe_groups"], out["moe_topk_groups"]
    if experts % groups or not 0 < topk_groups <= groups or topk_groups * (experts // groups) < top_k:
        raise UserError(
            f"{name}: n_routed_experts ({experts}) must split into n_group ({groups}) equal groups and the "
            f"topk_group ({topk_groups}) best groups must hold num_experts_per_tok ({top_k}) experts"
        )
    return out


def write_router(arch: Any) -> Dict[str, Any]:
    return {key: getattr(arch, field) for key, field, _ in ROUTER_KEYS}


# the config.json keys the router reads and the Family settings of a family with this router
ROUTER_KNOWN_KEYS = (*(key for key, _, _ in ROUTER_KEYS), "num_local_experts", "router_aux_loss_coef")
ROUTER_FAMILY: Dict[str, Any] = dict(
    moe=True,
    moe_scoring="sigmoid",
    # transformers keeps the score bias in the router (``mlp.gate.e_score_correction_bias``)
    hf_renames=((".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),),
)


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "partial_rotary_factor": rope_parameter(cfg, "partial_rotary_factor", 0.5),
        **read_router(cfg, "glm4_moe", {}),
    }


# config.json key -> ModelArch field, as transformers' Glm4MoeConfig names them (beside the router's)
_WRITTEN = (
    ("attention_bias", "attention_bias"),
    ("use_qk_norm", "qk_norm"),
    ("partial_rotary_factor", "partial_rotary_factor"),
)


def _write(arch: Any) -> Dict[str, Any]:
    return {**{key: getattr(arch, name) for key, name in _WRITTEN}, **write_router(arch)}


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
    known_keys=(*(key for key, _ in _WRITTEN), *ROUTER_KNOWN_KEYS),
    read_hf=_read,
    write_hf=_write,
    **ROUTER_FAMILY,
)
