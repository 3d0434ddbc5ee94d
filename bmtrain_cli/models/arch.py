"""Model architecture as plain data (no Paddle import): family defaults, Hugging Face config.json
reading/writing, and the LoRA-targetable projections (parameter counts: models/param_count.py). Used by the model builder, validate-config and the planner.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.families import FAMILIES, MODEL_TYPES, family
from bmtrain_cli.models.families import deepseek_v3 as mla
from bmtrain_cli.models.families._linear import LinearAttention
from bmtrain_cli.models.known import KNOWN_MODELS


@dataclass(frozen=True)
class ModelArch:
    """Everything that decides the shapes and maths of the decoder. Family differences are flags."""

    family: str = "llama"
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 64
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or a GELU (GeGLU)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    fused_qkv: bool = False  # one W_pack projection (Baichuan)
    position_embedding: str = "rope"  # rope | alibi (Baichuan 13B)
    sliding_window: Optional[int] = None  # local attention window (Mistral)
    norm_head: bool = False  # LM head rows L2-normalised (Baichuan 2)
    mlp_bias: bool = False  # biases on gate/up/down (ERNIE 4.5's use_bias)
    fused_gate_up: bool = False  # one gate_up_proj holding [gate; up] (Phi-3, GLM-4)
    partial_rotary_factor: float = 1.0  # rope turns only the first fraction of each head (GLM-4, Phi-4-mini)
    rope_interleaved: bool = False  # rope rotates pairs (0, 1), (2, 3), ... not halves (ERNIE 4.5, GLM-4)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), the weights start at zero (Gemma)
    sandwich_norm: bool = False  # a norm on the attention and on the MLP output too (Gemma 3, GLM-4)
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: Optional[float] = None  # scores scaled by its -1/2 power, not head_dim's (Gemma)
    # per layer, "full_attention" or "sliding_attention" (Gemma 3); None: every layer alike (sliding when
    # sliding_window is set, as Mistral)
    layer_types: Optional[Tuple[str, ...]] = None
    rope_local_theta: Optional[float] = None  # rope base of the sliding layers, without scaling (Gemma 3)
    # scores / logits become cap * tanh(x / cap): the attention's before the mask, the LM head's (Gemma 2)
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid output gate (Qwen3.5)
    linear_attention: Optional[LinearAttention] = None  # Gated DeltaNet on "linear_attention" layers
    # mixture of experts (Qwen3-MoE, Mixtral): num_experts 0 = dense. A layer is sparse unless it is in
    # mlp_only_layers, every decoder_sparse_step-th layer (1: all); its experts are moe_intermediate_size wide
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral always does)
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()
    moe_layer_start: int = 0  # and between these layers only (ERNIE 4.5's moe_layer_start/end_index)
    moe_layer_end: Optional[int] = None
    moe_shared_experts: int = 0  # an always-on SwiGLU this many experts wide beside the routed ones (ERNIE)
    moe_score_bias: bool = False  # top-k picked on probs + e_score_correction_bias, weighted unbiased (ERNIE)
    moe_norm_min: float = 0.0  # the renormalisation divides by max(sum of top-k weights, this) (ERNIE)
    # group-limited top-k (GLM-4.5, DeepSeek-V3's n_group/topk_group): experts in moe_groups equal groups,
    # a group scored by the sum of its two best choice scores, the top-k taken in the best moe_topk_groups
    moe_groups: int = 1
    moe_topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by this (GLM-4.5)
    output_router_logits: bool = False  # add router_aux_loss_coef x the load-balancing loss to the loss
    router_aux_loss_coef: float = 0.001
    kv_lora_rank: int = 0  # > 0: multi-head latent attention (DeepSeek-V3); head_dim is the rope part of q/k
    q_lora_rank: int = 0  # 0: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    initializer_range: float = 0.02
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)  # unknown config.json keys, written back as-is

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @property
    def o_proj_bias(self) -> bool:
        """Whether ``attention_bias`` covers o_proj too (the family says: LLaMA and Qwen3 yes, Qwen2 no)."""
        return self.attention_bias and family(self.family).o_proj_bias

    @property
    def qkv_name(self) -> str:
        """The fused q/k/v projection's name (``fused_qkv``): W_pack (Baichuan) or qkv_proj (Phi-3)."""
        return family(self.family).qkv_name

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head the rotary embedding turns (even)."""
        return int(self.head_dim * self.partial_rotary_factor) // 2 * 2

    def layer_type(self, layer: int) -> str:
        """``full_attention`` or ``sliding_attention``: which mask and rotary table the layer takes."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        if self.linear_attention is not None:
            return LinearAttention.layer_type(layer)
        if self.sliding_window is None:
            return "full_attention"
        pattern = family(self.family).sliding_pattern
        return "full_attention" if pattern and (layer + 1) % pattern == 0 else "sliding_attention"

    def is_sparse(self, layer: int) -> bool:
        """Whether the layer's MLP is the mixture of experts (transformers' Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
            and self.moe_layer_start
            <= layer
            <= (self.num_hidden_layers if self.moe_layer_end is None else self.moe_layer_end)
        )

    def window_of(self, layer_type: str) -> Optional[int]:
        return self.sliding_window if layer_type == "sliding_attention" else None


@dataclass(frozen=True)
class ArchRule:
    """A rule the model builder enforces on an architecture. ``validate-config`` runs the same rules first
    (config/checks.py), so a config the builder would refuse never reaches a rank. ``example`` holds
    model_config values that break the rule (tests derive their cases from it)."""

    field: str  # the model_config key to blame
    broken: Any  # ModelArch -> bool
    message: Any  # ModelArch -> str
    example: Dict[str, Any]


ARCH_RULES: Tuple[ArchRule, ...] = (
    ArchRule(
        "num_key_value_heads",
        lambda a: a.num_attention_heads % a.num_key_value_heads != 0,
        lambda a: (
            f"num_attention_heads ({a.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({a.num_key_value_heads}): each key/value head serves a whole group of "
            "query heads"
        ),
        {"num_attention_heads": 4, "num_key_value_heads": 3},
    ),
    ArchRule(
        "position_embedding",
        lambda a: a.position_embedding not in family(a.family).positions,
        lambda a: (
            f"position_embedding {a.position_embedding!r} is not supported by the {a.family} family "
            f"({' or '.join(family(a.family).positions)})"
        ),
        {"family": "llama", "position_embedding": "alibi"},
    ),
    ArchRule(
        "sliding_window",
        lambda a: a.sliding_window is not None and not family(a.family).sliding_window,
        lambda a: (
            f"the {a.family} family has no sliding-window attention (its checkpoints would not say so to "
            f"transformers); families with one: {', '.join(n for n, f in FAMILIES.items() if f.sliding_window)}"
        ),
        {"family": "llama", "sliding_window": 8},
    ),
    ArchRule(
        "num_experts",
        lambda a: a.num_experts > 0 and not family(a.family).moe,
        lambda a: (
            f"the {a.family} family has no mixture of experts; families with one: "
            f"{', '.join(n for n, f in FAMILIES.items() if f.moe)}"
        ),
        {"family": "llama", "num_experts": 4},
    ),
    ArchRule(
        "num_experts_per_tok",
        lambda a: a.num_experts > 0 and not 0 < a.num_experts_per_tok <= a.num_experts,
        lambda a: (
            f"num_experts_per_tok ({a.num_experts_per_tok}) must be between 1 and num_experts ({a.num_experts})"
        ),
        {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5},
    ),
    ArchRule(
        "output_router_logits",
        lambda a: a.output_router_logits and family(a.family).moe_scoring == "sigmoid",
        lambda a: (
            f"output_router_logits: the {a.family} family balances its experts with the score-correction "
            "bias; transformers defines no auxiliary load-balancing loss for it"
        ),
        {"family": "glm4_moe", "num_experts": 4, "output_router_logits": True},
    ),
)


def arch_problems(arch: ModelArch) -> Tuple[Tuple[str, str], ...]:
    """(model_config key, message) for every ARCH_RULES rule the architecture breaks."""
    return tuple((r.field, r.message(arch)) for r in ARCH_RULES if r.broken(arch))


# model_config keys that only some families write to config.json (latent attention, the sigmoid router)
FAMILY_SPECIFIC_KEYS = (
    "norm_topk_prob",
    "routed_scaling_factor",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "v_head_dim",
)
_ARCH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "attention_bias",
    "position_embedding",
    "sliding_window",
    "initializer_range",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "output_router_logits",
    "router_aux_loss_coef",
    *FAMILY_SPECIFIC_KEYS,
)
# model_config keys named as config.json names them -> the ModelArch field they set
MODEL_CONFIG_RENAMES = {
    "n_shared_experts": "moe_shared_experts",
    "first_k_dense_replace": "moe_layer_start",
    "n_group": "moe_groups",
    "topk_group": "moe_topk_groups",
    "qk_rope_head_dim": "head_dim",  # latent attention: head_dim is the rope part of q/k
}


def arch_from_model_config(model_cfg: Any, allow_known: bool = False) -> ModelArch:
    """Architecture of a model_config: the checkpoint's config.json when a path is given, else the
    family defaults; explicit sizes in model_config override either. With allow_known, a well-known
    hub id not present here resolves to its published architecture (for validate-config and plan)."""
    if getattr(model_cfg, "model_name_or_path", None):
        base = read_hf_config(model_cfg.model_name_or_path, allow_known=allow_known)
    else:
        base = replace(ModelArch(family=model_cfg.family), **family(model_cfg.family).defaults)
    updates = {k: getattr(model_cfg, k) for k in _ARCH_FIELDS if getattr(model_cfg, k, None) is not None}
    updates.update(
        {
            f: getattr(model_cfg, k)
            for k, f in MODEL_CONFIG_RENAMES.items()
            if getattr(model_cfg, k, None) is not None
        }
    )
    arch = replace(base, **updates)
    if (
        "num_attention_heads" in updates
        and "num_key_value_heads" not in updates
        and not model_cfg.model_name_or_path
    ):
        arch = replace(arch, num_key_value_heads=arch.num_attention_heads)
    if "head_dim" not in updates and ("hidden_size" in updates or "num_attention_heads" in updates):
        arch = replace(arch, head_dim=arch.hidden_size // arch.num_attention_heads)
    if arch.num_experts and not arch.moe_intermediate_size:  # a fresh MoE model: experts as wide as the MLP
        arch = replace(arch, moe_intermediate_size=arch.intermediate_size)
    return arch


def _rope(cfg: Dict[str, Any], default_theta: float = 10000.0) -> tuple:
    """(rope_theta, rope_scaling) from transformers 4.x (rope_theta, rope_scaling) or 5.x keys."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", default_theta))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params:
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        if rest.get("rope_type", rest.get("type", "default")) != "default":
            scaling = rest
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta), scaling


HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")
# structural flags a family fixes (its defaults), not read from config.json's shared keys
_FAMILY_FLAGS = (
    "moe_score_bias",
    "qk_norm",
    "fused_qkv",
    "fused_gate_up",
    "rope_interleaved",
    "norm_offset",
    "scale_embeddings",
    "partial_rotary_factor",
)
# config.json keys every family reads (beyond the ModelArch fields of the same name)
_SHARED_KEYS = (
    "model_type",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "architectures",
    "torch_dtype",
    "dtype",
    "transformers_version",
)


def arch_from_hf_dict(cfg: Dict[str, Any], source: str = "config.json") -> ModelArch:
    """Parse a Hugging Face config.json dict: the shared keys here, the family's own in its module."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UserError(
            f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    fam = FAMILIES[MODEL_TYPES[model_type]]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg, fam.default("rope_theta", 10000.0))
        act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if act not in HIDDEN_ACTS:
            raise UserError(f"{source}: hidden_act {act!r} is not supported ({', '.join(HIDDEN_ACTS)})")
        if cfg.get("mlp_bias"):
            raise UserError(f"{source}: mlp_bias=true is not supported")
        if cfg.get("use_sliding_window"):
            raise UserError(f"{source}: use_sliding_window=true (per-layer sliding windows) is not supported")
        known = set(_ARCH_FIELDS) | set(_SHARED_KEYS) | set(fam.known_keys)
        shared = dict(
            family=fam.name,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(
                cfg.get("max_position_embeddings", cfg.get("model_max_length", 4096))
            ),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            hidden_act=act,
            tie_word_embeddings=bool(
                cfg.get("tie_word_embeddings", fam.default("tie_word_embeddings", False))
            ),
            attention_bias=bool(cfg.get("attention_bias", fam.default("attention_bias", False))),
            **{key: fam.default(key, getattr(ModelArch, key)) for key in _FAMILY_FLAGS},
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            extra={k: v for k, v in cfg.items() if k not in known},
        )
        return ModelArch(**{**shared, **fam.read_hf(cfg)})
    except KeyError as exc:
        raise UserError(f"{source}: missing required key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"{source}: bad value ({exc})") from None


def read_hf_config(path: str, allow_known: bool = False) -> ModelArch:
    """Read ``path/config.json`` of a Hugging Face-style checkpoint directory. With allow_known, a
    well-known hub id that is not present locally resolves to its published architecture."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not p.exists():
        if allow_known and path in KNOWN_MODELS:
            return arch_from_hf_dict(dict(KNOWN_MODELS[path]), path)
        raise UserError(f"{path} does not exist (expected a local Hugging Face-style checkpoint directory)")
    if not cfg_file.is_file():
        raise UserError(f"{path}: no config.json (expected a Hugging Face-style checkpoint directory)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{cfg_file}: not valid JSON ({exc})") from None
    return arch_from_hf_dict(cfg, str(cfg_file))


def arch_to_hf_dict(arch: ModelArch, dtype: str = "float32") -> Dict[str, Any]:
    """The config.json of a checkpoint with this architecture (keys transformers 4.x and 5.x read).
    Unknown keys read from the original config.json are written back unchanged."""
    cfg: Dict[str, Any] = {
        "architectures": [family(arch.family).hf_architecture],
        "model_type": family(arch.family).model_types[0],
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_hidden_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "vocab_size": arch.vocab_size,
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        "hidden_act": arch.hidden_act,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "initializer_range": arch.initializer_range,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "pad_token_id": arch.pad_token_id,
        "torch_dtype": dtype,
    }
    if arch.attention_bias != family(arch.family).default("attention_bias", False):
        cfg["attention_bias"] = arch.attention_bias
    if arch.position_embedding == "rope":
        cfg["rope_theta"] = arch.rope_theta
        cfg["rope_scaling"] = dict(arch.rope_scaling) if arch.rope_scaling else None
    else:
        cfg["position_embedding"] = arch.position_embedding
    cfg.update(family(arch.family).write_hf(arch))
    for k, v in arch.extra.items():
        cfg.setdefault(k, v)
    return cfg


# Linear projections of a decoder layer that LoRA can target (the fused ones only in their families).
LORA_PROJECTIONS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "W_pack",
    "qkv_proj",
    "gate_up_proj",
    *mla.MLA_PROJECTIONS,
    *LinearAttention.PROJECTIONS,
)
ROW_PARALLEL_PROJECTIONS = ("o_proj", "down_proj", "out_proj")


def lora_targets(arch: ModelArch, names: Any) -> Tuple[str, ...]:
    """The projection names a lora_target_modules setting selects ("all-linear" = every projection)."""
    names = [names] if isinstance(names, str) else list(names)
    every = tuple(n for n in LORA_PROJECTIONS if arch.kv_lora_rank or n not in mla.MLA_PROJECTIONS)
    return every if "all-linear" in names else tuple(names)


def arch_projections(arch: ModelArch) -> Tuple[str, ...]:
    """The LoRA-targetable projections this architecture has (Baichuan fuses q/k/v into W_pack, Phi-3 into
    qkv_proj; Phi-3 and GLM-4 fuse gate/up into gate_up_proj)."""
    qkv: Tuple[str, ...] = (arch.qkv_name,) if arch.fused_qkv else ("q_proj", "k_proj", "v_proj")
    qkv = mla.mla_projections(arch) if arch.kv_lora_rank else qkv
    mlp = ("gate_up_proj",) if arch.fused_gate_up else ("gate_proj", "up_proj")
    mixer = (*qkv, "o_proj", *(LinearAttention.PROJECTIONS if arch.linear_attention else ()))
    return tuple(n for n in LORA_PROJECTIONS if n in (*mixer, *mlp, "down_proj"))


def projection_shapes(arch: ModelArch) -> Dict[str, Tuple[int, int]]:
    """(in, out) of each projection a decoder layer may hold (arch_projections says which it has)."""
    h, hd = arch.hidden_size, arch.head_dim
    q, kv, inter = arch.num_attention_heads * hd, arch.num_key_value_heads * hd, arch.intermediate_size
    return {
        **(arch.linear_attention.projection_shapes(h) if arch.linear_attention else {}),
        "q_proj": (h, q * 2 if arch.attn_output_gate else q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
        "W_pack": (h, q + 2 * kv),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * inter),
        **(mla.mla_shapes(arch) if arch.kv_lora_rank else {}),
    }


def lora_parameters_per_layer(arch: ModelArch, rank: int, targets: Any, tp: int = 1) -> int:
    """Adapter parameters (A: in x r, B: r x out) of one decoder layer on one tensor-parallel rank:
    column-parallel projections split B's output, row-parallel ones A's input."""
    selected = set(lora_targets(arch, targets)) & set(arch_projections(arch))
    return sum(
        rank * (i // tp + o) if name in ROW_PARALLEL_PROJECTIONS else rank * (i + o // tp)
        for name, (i, o) in projection_shapes(arch).items()
        if name in selected
    )
