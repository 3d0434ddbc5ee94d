"""ERNIE 4.5 (dense; Baidu's ERNIE-4.5-0.3B and the other ``model_type: ernie4_5`` checkpoints): rope on
interleaved pairs, ``use_bias`` on every projection, tied embeddings, head_dim set on its own."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    bias = bool(cfg.get("use_bias", False))
    return {"attention_bias": bias, "mlp_bias": bias}


FAMILY = Family(
    name="ernie4_5",
    model_types=("ernie4_5",),
    hf_architecture="Ernie4_5ForCausalLM",
    description="ERNIE 4.5 (dense): interleaved rope, use_bias, tied embeddings",
    defaults={"rope_interleaved": True, "rope_theta": 500000.0, "tie_word_embeddings": True},
    known_keys=("use_bias",),
    read_hf=_read,
    write_hf=lambda arch: {"use_bias": arch.attention_bias},
    free_head_dim=True,
)
