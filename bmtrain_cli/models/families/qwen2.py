"""Qwen2 / Qwen2.5: LLaMA with biases on the q/k/v projections (not on o_proj)."""

from bmtrain_cli.models.families._base import Family

FAMILY = Family(
    name="qwen2",
    model_types=("qwen2",),
    hf_architecture="Qwen2ForCausalLM",
    description="Qwen2/Qwen2.5: q/k/v biases, rope_theta 1e6",
    defaults={"attention_bias": True, "rope_theta": 1000000.0},
    o_proj_bias=False,
)
