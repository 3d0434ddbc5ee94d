"""LLaMA 1/2/3 (and every checkpoint with ``model_type: llama``): the shared decoder as it is."""

from bmtrain_cli.models.families._base import Family

FAMILY = Family(
    name="llama",
    model_types=("llama",),
    hf_architecture="LlamaForCausalLM",
    description="LLaMA 1/2/3: RoPE, SwiGLU, RMSNorm, grouped-query attention",
    write_hf=lambda arch: {"attention_bias": arch.attention_bias},
)
