"""Qwen3 (dense): per-head RMSNorm of q and k, head_dim set on its own."""

from bmtrain_cli.models.families._base import Family

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    hf_architecture="Qwen3ForCausalLM",
    description="Qwen3: q/k RMSNorm per head, explicit head_dim",
    defaults={"qk_norm": True, "rope_theta": 1000000.0},
    free_head_dim=True,
    write_hf=lambda arch: {"attention_bias": arch.attention_bias},
)
