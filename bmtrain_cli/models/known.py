"""Published architectures of well-known checkpoints (config.json keys), for validate-config and plan."""

from typing import Any, Dict


def _published(
    model_type: str,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    context: int,
    **keys: Any,
) -> Dict[str, Any]:
    """One checkpoint's config.json: the sizes every family has, then its own keys."""
    return dict(
        model_type=model_type,
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=context,
        **keys,
    )


# what the ERNIE 4.5 checkpoints share (dense and mixture of experts)
_ERNIE_4_5: Dict[str, Any] = dict(
    head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, use_bias=False
)

# Published architectures of well-known checkpoints, so that validate-config and plan can size a
# config written for another machine (the weights themselves are only ever read from a local path).
# Columns: model_type, layers, hidden, ffn, heads, kv_heads, vocab, context, then the checkpoint's own keys.
KNOWN_MODELS: Dict[str, Dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _published("llama", 32, 4096, 11008, 32, 32, 32000, 4096, rms_norm_eps=1e-5),
    "meta-llama/Llama-2-13b-hf": _published("llama", 40, 5120, 13824, 40, 40, 32000, 4096, rms_norm_eps=1e-5),
    "meta-llama/Llama-2-70b-hf": _published("llama", 80, 8192, 28672, 64, 8, 32000, 4096, rms_norm_eps=1e-5),
    "meta-llama/Meta-Llama-3-8B": _published(
        "llama", 32, 4096, 14336, 32, 8, 128256, 8192, rope_theta=500000.0, rms_norm_eps=1e-5
    ),
    "Qwen/Qwen2.5-7B-Instruct": _published(
        "qwen2", 28, 3584, 18944, 28, 4, 152064, 32768, rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=True
    ),
    "baidu/ERNIE-4.5-0.3B-PT": _published(
        "ernie4_5",
        18,
        1024,
        3072,
        16,
        2,
        103424,
        131072,
        **_ERNIE_4_5,
    ),
    # transformers' Ernie4_5_MoeConfig defaults, which are this checkpoint's
    "baidu/ERNIE-4.5-21B-A3B-PT": _published(
        "ernie4_5_moe",
        28,
        2560,
        12288,
        20,
        4,
        103424,
        131072,
        **_ERNIE_4_5,
        **{  # its experts: 64 routed (top 6) and 2 shared in layers 1-27
            "moe_num_experts": 64,
            "moe_k": 6,
            "moe_intermediate_size": 1536,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
            "moe_layer_end_index": 27,
            "moe_layer_interval": 1,
            "moe_norm_min": 1e-12,
        },
    ),
    # Qwen3's mixture of experts: 48 layers of 128 routed experts (8 per token), 30.5B parameters, 3.3B active
    "Qwen/Qwen3-30B-A3B": _published(
        "qwen3_moe",
        48,
        2048,
        6144,
        32,
        4,
        151936,
        40960,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **{
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
        },
    ),
    "baichuan-inc/Baichuan2-7B-Chat": _published(
        "baichuan", 32, 4096, 11008, 32, 32, 125696, 4096, rope_theta=10000.0, rms_norm_eps=1e-6
    ),
}
