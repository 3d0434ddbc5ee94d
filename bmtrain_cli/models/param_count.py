"""Exact parameter counts of a decoder described by a :class:`~bmtrain_cli.models.arch.ModelArch` (no
Paddle import): what the run reports, the planner budgets and the MoE summary calls active."""

from __future__ import annotations

from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.families import deepseek_v3 as mla
from bmtrain_cli.models.families import family
from bmtrain_cli.models.families._linear import LinearAttention


def count_active_parameters(arch: ModelArch) -> int:
    return count_parameters(arch, active=True)  # a sparse layer counts its router and top-k experts only


def count_parameters(arch: ModelArch, active: bool = False) -> int:
    """Exact parameter count of the decoder described by ``arch`` (``active``: see count_active_parameters)."""
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * hd
    kv = arch.num_key_value_heads * hd
    attn = h * (q * (2 if arch.attn_output_gate else 1) + 2 * kv) + q * h
    if arch.attention_bias:
        attn += q + 2 * kv
    if arch.o_proj_bias:
        attn += h
    if arch.qk_norm:
        attn += 2 * hd
    attn = mla.mla_parameters(arch) if arch.kv_lora_rank else attn
    norms = len(family(arch.family).norm_names) * h
    sparse = sparse_layers(arch)
    total = arch.vocab_size * h + arch.num_hidden_layers * norms + h
    total += LinearAttention.mixer_parameters(arch, attn)
    total += (arch.num_hidden_layers - sparse) * mlp_parameters(arch) + sparse * moe_parameters(arch, active)
    if not arch.tie_word_embeddings:
        total += arch.vocab_size * h
    return total


def sparse_layers(arch: ModelArch) -> int:
    """How many decoder layers are a mixture of experts."""
    return sum(arch.is_sparse(i) for i in range(arch.num_hidden_layers)) if arch.num_experts else 0


def mlp_parameters(arch: ModelArch) -> int:
    """One dense layer's MLP (gate, up, down; their biases under mlp_bias)."""
    h = arch.hidden_size
    return 3 * h * arch.intermediate_size + (2 * arch.intermediate_size + h if arch.mlp_bias else 0)


def moe_parameters(arch: ModelArch, active: bool = False) -> int:
    """One sparse layer's MLP: the router, every routed expert (``active``: the top k a token passes),
    the shared experts and the score-correction bias."""
    h = arch.hidden_size
    experts = arch.num_experts_per_tok if active else arch.num_experts
    moe = h * arch.num_experts + experts * 3 * h * arch.moe_intermediate_size
    shared = arch.moe_shared_experts * arch.moe_intermediate_size
    moe += 3 * h * shared + (2 * shared + h if arch.mlp_bias and shared else 0)
    return moe + (arch.num_experts if arch.moe_score_bias else 0)
