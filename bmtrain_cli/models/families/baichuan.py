"""Baichuan / Baichuan 2: fused W_pack q/k/v projection; ALiBi in the 13B models; Baichuan 2 normalises
the LM head rows."""

from typing import Any, Dict, Mapping

from bmtrain_cli.models.families._base import Family


def _read(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    position = cfg.get("position_embedding")
    if position is None:
        # Baichuan/Baichuan2-13B use ALiBi and have no rope settings; the 7B models use RoPE.
        position = "alibi" if int(cfg["hidden_size"]) == 5120 and "rope_theta" not in cfg else "rope"
    # Baichuan 2 (vocab 125696, z_loss_weight in its config) normalises the LM head rows.
    norm_head = cfg.get("norm_head", "z_loss_weight" in cfg or int(cfg["vocab_size"]) == 125696)
    return {"position_embedding": position, "norm_head": bool(norm_head)}


FAMILY = Family(
    name="baichuan",
    model_types=("baichuan",),
    hf_architecture="BaichuanForCausalLM",
    description="Baichuan/Baichuan 2: fused W_pack, ALiBi (13B), normalised LM head (Baichuan 2)",
    defaults={"fused_qkv": True},
    known_keys=("fused_qkv", "norm_head", "position_embedding"),
    read_hf=_read,
    positions=("rope", "alibi"),
    write_hf=lambda arch: {"norm_head": arch.norm_head},
)
