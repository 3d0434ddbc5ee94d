"""The record every family module fills in (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Tuple


def _no_extra_keys(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    return {}


def _nothing_to_write(arch: Any) -> Dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family. ``read_hf(config_json) -> {ModelArch field: value}`` reads what only this family
    has; ``write_hf(arch) -> {config.json key: value}`` writes it back (transformers 4.x and 5.x names)."""

    name: str
    model_types: Tuple[str, ...]
    hf_architecture: str
    description: str
    defaults: Dict[str, Any] = field(default_factory=dict)
    known_keys: Tuple[str, ...] = ()  # config.json keys read by read_hf (not kept as unknown extras)
    read_hf: Callable[[Mapping[str, Any]], Dict[str, Any]] = _no_extra_keys
    write_hf: Callable[[Any], Dict[str, Any]] = _nothing_to_write
    # Hugging Face puts ``attention_bias`` on o_proj too (LLaMA, Qwen3) or only on q/k/v (Qwen2)
    o_proj_bias: bool = True
    positions: Tuple[str, ...] = ("rope",)  # position encodings the family's checkpoints use
    # head_dim is its own setting (Qwen3), not hidden_size / num_attention_heads
    free_head_dim: bool = False

    def default(self, key: str, fallback: Any) -> Any:
        return self.defaults.get(key, fallback)
