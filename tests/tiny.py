"""The tiny model the LoRA, data and integration tests train (hidden 64, 2 layers, 4 heads, GQA 4/2): one
definition for their ModelArch and for the integration tests' YAML configs. (The model tests use their own,
tests/unit/models/tiny.py, with odd sizes that catch shape mistakes.)"""

from __future__ import annotations

from typing import Any, Optional

from bmtrain_cli.models.arch import ModelArch

ARCH = ModelArch(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)


def model_dict(max_seq_len: int = 32, **extra: Any) -> dict:
    """The ``model_config`` mapping of a tiny fresh LLaMA with the default (multi-head) attention, for
    tests that write their config with yaml.safe_dump; ``extra`` adds or replaces keys."""
    return {
        "family": "llama",
        "hidden_size": ARCH.hidden_size,
        "intermediate_size": ARCH.intermediate_size,
        "num_hidden_layers": ARCH.num_hidden_layers,
        "num_attention_heads": ARCH.num_attention_heads,
        "max_seq_len": max_seq_len,
        **extra,
    }


def model_yaml(
    max_seq_len: int = 32, kv_heads: Optional[int] = 2, kernels: Optional[str] = "reference", **extra: Any
) -> str:
    """The ``model_config:`` block of a tiny fresh LLaMA (no braces, so it can be joined to a template
    that is ``str.format``-ed). ``kv_heads``/``kernels`` None leave the defaults; ``extra`` adds keys."""
    fields = {
        "family": "llama",
        "hidden_size": ARCH.hidden_size,
        "intermediate_size": ARCH.intermediate_size,
        "num_hidden_layers": ARCH.num_hidden_layers,
        "num_attention_heads": ARCH.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "max_seq_len": max_seq_len,
        "kernels": kernels,
        **extra,
    }
    lines = ["model_config:"]
    for key, value in fields.items():
        if value is not None:
            lines.append(f"  {key}: {str(value).lower() if isinstance(value, bool) else value}")
    return "\n".join(lines) + "\n"
