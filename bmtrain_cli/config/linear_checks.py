"""validate-config checks of models with Gated DeltaNet linear-attention layers (Qwen3.5,
models/linear_attention.py): its layers run on one device per model replica, in dygraph, on rows that
each hold one sample."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.config.refusals import refuse_model_parallel


def check_linear_attention(config: Any, arch: Any, err: Callable[..., None]) -> None:
    if arch is None or arch.linear_attention is None:
        return
    t = config.train
    what = f"the {arch.family} linear attention (Gated DeltaNet)"
    refuse_model_parallel(
        config.parallel,
        what,
        "their heads and recurrent state are not split across ranks",
        "use data_parallel and/or sharding_parallel",
        err,
    )
    if t.batching == "packed":
        err(
            "train_config.batching",
            f"{what} carries a recurrent state along the row; packed rows would leak it from one sample "
            "into the next",
            "use batching: longest or max_length",
        )
    if t.to_static:
        err(
            "train_config.to_static",
            f"{what} is not trained as a static graph yet (its chunk loop is only exported for inference)",
            "set to_static: false",
        )
