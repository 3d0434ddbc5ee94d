"""Mixtral: LLaMA/Mistral attention (optional sliding window) with a mixture of SwiGLU experts in every
layer. Hub checkpoints name them ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1/w3/w2``
(gate/up/down); they are read and written under those names and kept as ``mlp.*`` here. The top-k routing
weights are always renormalised."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family
from bmtrain_cli.models.families.qwen3_moe import MOE_KEYS, read_moe, write_moe


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {
        **read_moe(cfg, "num_local_experts"),
        "norm_topk_prob": True,
        "sliding_window": int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
    }


def _write(arch: Any) -> Dict[str, Any]:
    return {
        **write_moe(arch, "num_local_experts"),
        "intermediate_size": arch.moe_intermediate_size,
        "sliding_window": arch.sliding_window,
    }


FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    hf_architecture="MixtralForCausalLM",
    description="Mixtral: LLaMA attention, top-k routed SwiGLU experts in every layer",
    defaults={"num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rope_theta": 1000000.0},
    known_keys=(*MOE_KEYS, "sliding_window"),
    read_hf=_read,
    moe=True,
    write_hf=_write,
    sliding_window=True,
    # (our name, the checkpoint's): hf.py renames on the way in and back on the way out
    hf_renames=(
        (".mlp.gate.", ".block_sparse_moe.gate."),
        (".mlp.experts.", ".block_sparse_moe.experts."),
        (".gate_proj.", ".w1."),
        (".up_proj.", ".w3."),
        (".down_proj.", ".w2."),
    ),
)
