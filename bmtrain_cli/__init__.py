"""bmtrain-cli: a PaddlePaddle-native, YAML-driven command line for fine-tuning LLMs.

The Python API on a user's own model (the bmtrain_cli/api/ package; docs/api.md) is exported here and imported on
first use, so ``import bmtrain_cli`` does not import Paddle."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "PipelineParallel",
    "TensorParallel",
    "init_distributed",
    "init_distributed_mode",
    "train_step",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from bmtrain_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'bmtrain_cli' has no attribute {name!r}")
