"""The llama.cpp architecture each family's GGUF file is written as, what llama.cpp fixes for it that a
model must match (refused with the reason otherwise), and the architecture metadata written; the tensor
layout and the rules behind these refusals are in ``gguf_export``'s docstring."""

from __future__ import annotations

from typing import Any, List

from bmtrain_cli.errors import UserError

# our family -> llama.cpp architecture (Mistral is "llama" there, as in llama.cpp's converter)
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "baichuan": "baichuan",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3moe",
    "ernie4_5": "ernie4_5",
    "glm4": "glm4",
    "mixtral": "llama",
    "ernie4_5_moe": "ernie4_5-moe",
    "glm4_moe": "glm4moe",
    "gemma2": "gemma2",
}
# what llama.cpp's gemma3 assumes rather than reads
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_THETA = 10000.0
_BAICHUAN_ROPE_LAYERS = 32  # llama.cpp's baichuan: 32 layers rotate q/k, any other count runs unrotated


def check_exportable(arch: Any) -> str:
    """The llama.cpp architecture name of ``arch``; UserError for what llama.cpp would run differently."""
    from bmtrain_cli.models.rope import rope_type

    if arch.linear_attention is not None:
        raise UserError(
            f"--format gguf: the {arch.family} linear-attention (Gated DeltaNet) layers are not written to "
            "GGUF (llama.cpp's layout of their convolution, gates and recurrent state is not checked against "
            "a llama.cpp build here); export --format hf and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    if arch.family not in GGUF_ARCHS:
        raise UserError(
            f"--format gguf: the {arch.family} family is not written to GGUF (written: "
            f"{', '.join(GGUF_ARCHS)}); export --format hf and convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    if arch.position_embedding == "alibi":
        raise UserError(
            "--format gguf: ALiBi Baichuan (13B) is not exported (llama.cpp picks ALiBi from the layer "
            "count, not from the file); export --format hf instead"
        )
    kind = rope_type(arch.rope_scaling)
    supported = (
        "default",
        "linear",
        *(("llama3",) if GGUF_ARCHS[arch.family] == "llama" else ()),
        *(("longrope",) if arch.family == "phi3" else ()),
    )
    if kind not in supported:
        raise UserError(
            f"--format gguf: rope_scaling type {kind!r} is not exported for {arch.family} (llama.cpp does not "
            f"compute it as the trained model does); supported: none, {', '.join(supported[1:])}"
        )
    problems = _llama_cpp_assumptions(arch)
    if problems:
        raise UserError(f"--format gguf: {'; '.join(problems)}; export --format hf instead")
    return GGUF_ARCHS[arch.family]


def _llama_cpp_assumptions(arch: Any) -> List[str]:
    """What llama.cpp fixes for the family where ``arch`` differs (see gguf_export's docstring)."""
    problems = []
    if arch.family == "gemma3_text":
        layers = range(arch.num_hidden_layers)
        expected = [
            "full_attention" if (i + 1) % _GEMMA3_PATTERN == 0 else "sliding_attention" for i in layers
        ]
        if [arch.layer_type(i) for i in layers] != expected:
            problems.append(
                f"llama.cpp's gemma3 makes every {_GEMMA3_PATTERN}th layer global, this model does not"
            )
        if (arch.rope_local_theta or _GEMMA3_LOCAL_THETA) != _GEMMA3_LOCAL_THETA:
            problems.append(f"llama.cpp's gemma3 uses rope base {_GEMMA3_LOCAL_THETA:g} on sliding layers")
        if arch.query_pre_attn_scalar not in (None, arch.head_dim):
            problems.append(
                "llama.cpp's gemma3 scales scores by head_dim^-1/2, not query_pre_attn_scalar^-1/2"
            )
    if arch.family == "gemma2":
        problems += _gemma2_assumptions(arch)
    if arch.family == "qwen3_moe":
        if not all(arch.is_sparse(i) for i in range(arch.num_hidden_layers)):
            problems.append(
                "llama.cpp's qwen3moe has experts in every layer (mlp_only_layers/decoder_sparse_step)"
            )
        if not arch.norm_topk_prob:
            problems.append("llama.cpp's qwen3moe renormalises the top-k weights (norm_topk_prob: false)")
    if arch.family in ("ernie4_5_moe", "glm4_moe"):
        layers = range(arch.num_hidden_layers)
        if [arch.is_sparse(i) for i in layers] != [i >= arch.moe_layer_start for i in layers]:
            problems.append(
                f"llama.cpp's {GGUF_ARCHS[arch.family]} has experts in every layer after the "
                f"{arch.moe_layer_start} leading dense ones (an interval of 1, up to the last layer)"
            )
    if arch.family == "glm4_moe":
        if not arch.moe_shared_experts:
            problems.append("llama.cpp's glm4moe always adds a shared expert (n_shared_experts: 0)")
        if arch.routed_scaling_factor == 0:
            problems.append(
                "llama.cpp's glm4moe reads expert_weights_scale 0 as no scaling (routed_scaling_factor: 0)"
            )
    if arch.family == "baichuan" and arch.num_hidden_layers != _BAICHUAN_ROPE_LAYERS:
        problems.append(
            f"llama.cpp's baichuan applies RoPE only to {_BAICHUAN_ROPE_LAYERS}-layer (7B) models, "
            f"this one has {arch.num_hidden_layers} layers"
        )
    return problems


def _gemma2_assumptions(arch: Any) -> List[str]:
    """llama.cpp's gemma2: even layers slide; both caps always applied; scores scaled by head_dim^-1/2
    (hidden / heads in its 46-layer 27B)."""
    problems = []
    layers = range(arch.num_hidden_layers)
    if [arch.layer_type(i) for i in layers] != [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in layers
    ]:
        problems.append(
            "llama.cpp's gemma2 makes the even layers sliding and the odd ones global, this model does not"
        )
    if arch.sliding_window is None:
        problems.append("llama.cpp's gemma2 always has sliding layers (sliding_window unset)")
    if arch.attn_logit_softcapping is None or arch.final_logit_softcapping is None:
        problems.append("llama.cpp's gemma2 always soft-caps scores and logits (a cap is unset)")
    scale_dim = (
        arch.hidden_size // arch.num_attention_heads if arch.num_hidden_layers == 46 else arch.head_dim
    )
    if arch.query_pre_attn_scalar not in (None, scale_dim):
        problems.append(
            f"llama.cpp's gemma2 scales scores by {scale_dim}^-1/2 (head_dim; hidden/heads at 46 layers), "
            "not query_pre_attn_scalar^-1/2"
        )
    return problems


def add_hparams(w: Any, arch: Any, gguf: Any) -> None:
    """The architecture metadata llama.cpp reads for ``arch`` (``gguf`` the gguf module)."""
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_block_count(arch.num_hidden_layers)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_attention_heads)
    w.add_head_count_kv(arch.num_key_value_heads)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_rope_dimension_count(arch.rotary_dim)
    w.add_vocab_size(arch.vocab_size)
    if arch.head_dim * arch.num_attention_heads != arch.hidden_size or arch.family in (
        "gemma3_text",
        "gemma2",
    ):
        w.add_key_length(arch.head_dim)
        w.add_value_length(arch.head_dim)
    if arch.sliding_window is not None:
        w.add_sliding_window(arch.sliding_window)
    if arch.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(arch.attn_logit_softcapping)
    if arch.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(arch.final_logit_softcapping)
    if arch.num_experts:
        w.add_expert_count(arch.num_experts)
        w.add_expert_used_count(arch.num_experts_per_tok)
        w.add_expert_feed_forward_length(arch.moe_intermediate_size)
    if arch.family in _MOE_HPARAMS:
        _MOE_HPARAMS[arch.family](w, arch, gguf)
    from bmtrain_cli.models.rope import inv_frequencies, rope_type

    scaling = arch.rope_scaling or {}
    kind = rope_type(arch.rope_scaling)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif kind == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        _, attention_factor = inv_frequencies(
            arch.rotary_dim, arch.rope_theta, scaling, arch.max_position_embeddings
        )
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(attention_factor)


def _shared_and_dense(w: Any, arch: Any) -> None:
    """Leading dense layers and shared experts (ERNIE 4.5 MoE, GLM-4.5)."""
    w.add_leading_dense_block_count(arch.moe_layer_start)
    w.add_expert_shared_count(arch.moe_shared_experts)
    w.add_expert_shared_feed_forward_length(arch.moe_intermediate_size * arch.moe_shared_experts)


def _ernie4_5_moe_hparams(w: Any, arch: Any, gguf: Any) -> None:
    w.add_interleave_moe_layer_step(arch.decoder_sparse_step)
    _shared_and_dense(w, arch)


def _glm4_moe_hparams(w: Any, arch: Any, gguf: Any) -> None:
    _shared_and_dense(w, arch)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_norm(arch.norm_topk_prob)
    w.add_expert_weights_scale(arch.routed_scaling_factor)
    if arch.moe_topk_groups < arch.moe_groups:  # all groups kept is no limit (llama.cpp refuses it written)
        w.add_expert_group_count(arch.moe_groups)
        w.add_expert_group_used_count(arch.moe_topk_groups)


# the MoE settings a family's llama.cpp architecture reads beyond the expert counts and width
_MOE_HPARAMS = {"ernie4_5_moe": _ernie4_5_moe_hparams, "glm4_moe": _glm4_moe_hparams}
