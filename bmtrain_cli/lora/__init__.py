"""LoRA fine-tuning: adapters on the factory's linear layers, merge/unmerge, PEFT files, adapters-only
checkpoints that name and hash their base model. See docs/lora.md."""

from bmtrain_cli.lora.adapter_store import (
    find_base,
    hash_base,
    load_lora_checkpoint,
    merge_checkpoint,
)
from bmtrain_cli.lora.inject import LoRASettings, apply_lora, available_targets, lora_layers, trainable_count
from bmtrain_cli.lora.layers import LoRALinear
from bmtrain_cli.lora.merge import merge_lora, save_adapters, strip_lora, unmerge_lora

__all__ = [
    "LoRALinear",
    "LoRASettings",
    "apply_lora",
    "available_targets",
    "find_base",
    "hash_base",
    "load_lora_checkpoint",
    "lora_layers",
    "merge_checkpoint",
    "merge_lora",
    "save_adapters",
    "strip_lora",
    "trainable_count",
    "unmerge_lora",
]
