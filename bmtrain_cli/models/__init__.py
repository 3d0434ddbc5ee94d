"""Models: one decoder for LLaMA, Qwen2/3, Mistral and Baichuan; Hugging Face checkpoints in and out.

Attributes load lazily so that ``bmtrain_cli.models.arch`` (plain data) can be imported by the config
code without importing Paddle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build": "bmtrain_cli.models.hf",
    "load_pretrained": "bmtrain_cli.models.hf",
    "save_pretrained": "bmtrain_cli.models.hf",
    "hf_state_dict": "bmtrain_cli.models.hf",
    "load_hf_state_dict": "bmtrain_cli.models.hf",
    "CausalLM": "bmtrain_cli.models.decoder",
    "KVCache": "bmtrain_cli.models.decoder",
    "PlainFactory": "bmtrain_cli.models.layers",
    "ModelArch": "bmtrain_cli.models.arch",
    "read_hf_config": "bmtrain_cli.models.arch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'bmtrain_cli.models' has no attribute {name!r}")
