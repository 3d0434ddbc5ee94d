"""bmtrain-cli: a PaddlePaddle-native, YAML-driven command line for fine-tuning LLMs.

The Python API on a user's own model (the bmtrain_cli/api/ package; docs/api.md) is exported here and imported on
first use, so ``import bmtrain_cli`` does not import Paddle. It does set MKL_DEBUG_CPU_TYPE=5 on AMD CPUs
(bmtrain_cli/cpu_env.py: MKL's AVX2 code instead of its SSE code, 2.5x faster fp32 matmuls there)."""

from __future__ import annotations

from typing import Any

from bmtrain_cli.cpu_env import use_mkl_avx2_on_amd

use_mkl_avx2_on_amd()  # before Paddle's first matmul; see bmtrain_cli/cpu_env.py

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
        from bmtrain_cli.quiet import import_paddle

        import_paddle()  # without Paddle's import-time notices (its ccache warning), as the CLI does
        from bmtrain_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'bmtrain_cli' has no attribute {name!r}")
