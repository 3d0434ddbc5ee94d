"""Fused ops used by the models, with a choice of implementation.

``select(mode)`` returns an :class:`OpSet`: ``reference`` is pure Paddle (always available); ``custom``
uses our kernels from kernels/ (C++ on CPU, CUDA on GPU) and fails with a UserError when they cannot be
built; ``paddle`` uses Paddle's built-in fused ops where the device has them (reference elsewhere);
``auto`` picks, op by op, custom where built, else paddle where it exists, else reference, and warns once
when the custom build is unavailable; on a CPU, given the model's shapes (``shapes=OpShapes.of(arch)``)
and in a single process, it instead takes the choice recorded for those shapes on this machine, or times
the candidates of each op on them, takes the fastest (ops/measure.py) and records it. Which source each
op gets is decided by ops/choice.resolve, the function the memory plan calls too. Models call
``self.ops.rms_norm(...)`` and never know which one they got; ``OpSet.sources`` says which implementation
each op uses. Where our kernels run on a CPU (``custom``, or ``auto`` with the extension built) the set
also carries the fused attention core (``OpSet.attention``, ops/fused_attention.py), which the attention
runs instead of Paddle's.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Set

from bmtrain_cli.errors import NoticeWarning
from bmtrain_cli.ops import reference
from bmtrain_cli.ops.choice import MODES, OP_NAMES, OpShapes, measuring, resolve

__all__ = ["MODES", "OP_NAMES", "OpSet", "OpShapes", "REFERENCE", "select", "warn_fallback"]


class KernelFallbackWarning(NoticeWarning):
    """Custom kernels were requested by ``auto`` but could not be built; another implementation is used."""


_fallback_reasons: Set[str] = set()


def warn_fallback(reason: str, instead: str, stacklevel: int = 3) -> None:
    """One KernelFallbackWarning per reason and process: the ops and the CPU AdamW fall back for the same
    reason (no compiler), and the user reads it once."""
    first = (reason.splitlines() or ["unknown reason"])[0]
    if first in _fallback_reasons:
        return
    _fallback_reasons.add(first)
    warnings.warn(
        f"custom kernels unavailable ({first}); {instead}", KernelFallbackWarning, stacklevel=stacklevel
    )


@dataclass(frozen=True)
class OpSet:
    name: str
    rms_norm: Callable
    rotary: Callable
    swiglu: Callable
    linear_cross_entropy: Callable
    cross_entropy_sum: Callable
    sources: Dict[str, str] = field(default_factory=dict, compare=False)
    # auto on a CPU: seconds of forward + backward of each candidate on the model's shapes (ops/measure.py)
    timings: Dict[str, Dict[str, float]] = field(default_factory=dict, compare=False)
    # the fused CPU attention core (ops/fused_attention.py) where our kernels run on a CPU, else None:
    # models/attention.py's attend() then runs it as the ``cpu_fused`` kernel
    attention: Optional[Callable] = field(default=None, compare=False)
    # the chunked gated delta rule (Gated DeltaNet) where our kernels run on a CPU, else None: the
    # linear-attention layers then run ops/reference.gated_delta_rule
    delta_rule: Optional[Callable] = field(default=None, compare=False)
    # the routed MoE experts as one grouped GEMM (ops/moe_experts.py) where our kernels run (on a GPU: once
    # they passed their launch check), else None: models/moe.py then runs one matmul chain per expert
    moe_experts: Optional[Callable] = field(default=None, compare=False)


REFERENCE = OpSet(
    name="reference",
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    swiglu=reference.swiglu,
    linear_cross_entropy=reference.linear_cross_entropy,
    cross_entropy_sum=reference.cross_entropy_sum,
    sources={n: "reference" for n in OP_NAMES},
)

_cache: Dict[tuple, OpSet] = {}
_warned = False


def _device() -> str:
    import paddle

    return paddle.get_device()


def _custom_ops(device: str) -> Dict[str, Callable]:
    """Our kernels for this device; raises KernelBuildError with the reason when they are unavailable."""
    from bmtrain_cli.ops import build

    build.load_extension()
    if not device.startswith("cpu"):
        if not device.startswith("gpu") or not build.plan()[3]:
            raise build.KernelBuildError(
                f"the custom kernels were built for CPU only, but the device is {device} "
                "(a GPU build of Paddle and nvcc are needed for the CUDA kernels)"
            )
    from bmtrain_cli.ops import custom

    return {n: getattr(custom, n) for n in OP_NAMES}


def _launch_checked(ours: Dict[str, Callable], ref: Dict[str, Callable]) -> Dict[str, Callable]:
    """``auto`` on a GPU: only the kernels that launch and agree with the reference once (ops/launch_check.py)."""
    from bmtrain_cli.ops.launch_check import fallback_line, launch_checked, run_check

    kept, failed = launch_checked(ours, ref, run_check)
    if failed:
        warnings.warn(fallback_line(failed), KernelFallbackWarning, stacklevel=3)
    return kept


def _processes() -> int:
    """Ranks of this job (``PADDLE_TRAINERS_NUM``): auto times the ops in a single process only."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1)


def _measure(shapes: OpShapes, impls: Dict[str, Dict[str, Callable]]) -> Callable:
    """auto's timing on ``shapes`` (ops/measure.py) over the implementations by source. Paddle's random
    state is put back after it: a run that reads a recorded choice and one that times initialise a fresh
    model with the same weights."""

    def run(static: Dict[str, str]) -> Dict[str, Any]:
        import paddle

        from bmtrain_cli.ops import measure

        rng = paddle.get_rng_state()
        try:
            with paddle.set_grad_enabled(True):
                return measure.choose(shapes, impls, default=static)
        finally:
            paddle.set_rng_state(rng)

    return run


def select(mode: str = "auto", device: Optional[str] = None, shapes: Optional[OpShapes] = None) -> OpSet:
    """The op set for ``model_config.kernels`` on ``device`` (default: Paddle's current device).
    ``shapes``: the model's (OpShapes.of(arch)); with ``auto`` on a CPU the ops are then chosen by timing."""
    global _warned
    if mode not in MODES:
        raise ValueError(f"unknown kernels mode {mode!r} (choose one of {', '.join(MODES)})")
    if mode == "reference":
        return REFERENCE
    device = device or _device()
    key = (mode, device, shapes if measuring(mode, device, shapes, _processes()) else None)
    if key in _cache:
        return _cache[key]
    from bmtrain_cli.ops import build, paddle_fused

    impls: Dict[str, Dict[str, Callable]] = {
        "reference": {n: getattr(reference, n) for n in OP_NAMES},
        "paddle": paddle_fused.available(device),
    }
    ours: Dict[str, Callable] = {}
    if mode in ("auto", "custom"):
        try:
            ours = _custom_ops(device)
        except build.KernelBuildError as exc:
            if mode == "custom":
                from bmtrain_cli.errors import UserError

                raise UserError(
                    f"model_config.kernels is 'custom' but the custom kernels are unavailable: {exc}"
                ) from exc
            if not _warned:
                _warned = True
                warn_fallback(
                    str(exc) or type(exc).__name__,
                    "using Paddle's own ops instead (same results, slower)",
                )
        if ours and mode == "auto" and device.startswith("gpu"):
            ours = _launch_checked(ours, impls["reference"])
    impls["custom"] = ours
    timing = _measure(shapes, impls) if shapes is not None else None
    choice = resolve(mode, device, shapes, tuple(ours), _processes(), timing)
    fields = {op: impls[src][op] for op, src in choice.sources.items()}
    opset = OpSet(name=mode, sources=dict(choice.sources), timings=choice.timings, **fields)
    if ours and device.startswith("cpu"):
        from bmtrain_cli.ops.delta_rule import gated_delta_rule
        from bmtrain_cli.ops.fused_attention import fused_attention

        opset = replace(opset, attention=fused_attention, delta_rule=gated_delta_rule)
    from bmtrain_cli.ops import moe_experts

    grouped = moe_experts.for_device(mode, device, bool(ours))
    if grouped is not None:
        opset = replace(opset, moe_experts=grouped)
    _cache[key] = opset
    return opset
