"""GLM-4 (``model_type: glm4``, GLM-4-9B-0414 and its kin): rope on the first half of each head's
dimensions, on interleaved pairs; q/k/v biases; one gate_up_proj; norms on the attention and MLP outputs."""

from bmtrain_cli.models.families._base import Family, rope_parameter

FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    hf_architecture="Glm4ForCausalLM",
    o_proj_bias=False,  # q/k/v biases only
    free_head_dim=True,
    description="GLM-4: partial interleaved rope, q/k/v biases, fused gate_up, post-attention/MLP norms",
    known_keys=("partial_rotary_factor",),
    defaults={
        "attention_bias": True,
        "fused_gate_up": True,
        "rope_interleaved": True,
        "partial_rotary_factor": 0.5,
    },
    read_hf=lambda cfg: {"partial_rotary_factor": rope_parameter(cfg, "partial_rotary_factor", 0.5)},
    write_hf=lambda arch: {
        "partial_rotary_factor": arch.partial_rotary_factor,
        "attention_bias": arch.attention_bias,
    },
    norm_names={
        "pre_attn": "input_layernorm",
        "post_attn": "post_self_attn_layernorm",
        "pre_mlp": "post_attention_layernorm",
        "post_mlp": "post_mlp_layernorm",
    },
)
