"""Refusals several validate-config checks share."""

from __future__ import annotations

from typing import Any, Callable


def refuse_model_parallel(parallel: Any, what: str, why: str, hint: str, err: Callable[..., None]) -> None:
    """err() for tensor_parallel and pipeline_parallel above 1: ``what`` does not support them (``why``)."""
    for key in ("tensor_parallel", "pipeline_parallel"):
        if getattr(parallel, key) > 1:
            err(f"parallel_config.{key}", f"{what} does not support {key} > 1 yet ({why})", hint)
