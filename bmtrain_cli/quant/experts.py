"""The routed SwiGLU experts of an MoE layer (models/moe.py) whose projections are quantised (QLoRA on an
MoE family): ``(silu(x gate_e) * x up_e) down_e`` for every expert e over its rows (sorted by expert), as
three grouped calls, one per projection (ops/quant_experts.py: one C++ launcher call for all the experts
on a CPU, the per-expert reference elsewhere), with the layer's SwiGLU between them. LoRA on the experts'
projections adds each expert's ``lora_delta`` over its rows to the grouped base product.

:func:`quantised_experts` is the MoE layer's hook: None where the experts are not all quantised alike (the
layer then runs them one by one), and on a GPU, where each QuantLinear takes Paddle's weight-only kernels.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import paddle
from paddle import nn

from bmtrain_cli.ops.quant_experts import experts_linear
from bmtrain_cli.quant.layer import QuantLinear

PROJS = ("gate_proj", "up_proj", "down_proj")


def _base(proj: nn.Layer) -> Optional[QuantLinear]:
    """The bias-free QuantLinear a projection is, or wraps as an active LoRA layer's base (None else)."""
    base = proj if isinstance(proj, QuantLinear) else getattr(proj, "base_layer", None)
    if not isinstance(base, QuantLinear) or base.bias is not None:
        return None
    if base is not proj and (getattr(proj, "tp_kind", None) is not None or "bias" in proj._parameters):
        return None
    return base


def _adapted(proj: nn.Layer) -> bool:
    """Whether a projection adds a LoRA update to its base (a wrapper with its adapter on)."""
    return not isinstance(proj, QuantLinear) and bool(getattr(proj, "adapter_enabled", False))


def _impl(bases: Sequence[QuantLinear], rows: paddle.Tensor) -> Optional[str]:
    impls = {b.impl for b in bases}
    if impls == {"custom"} and rows.dtype == paddle.float32 and rows.place.is_cpu_place():
        return "custom"
    return "reference" if impls <= {"custom", "reference"} else None


def _projection(
    rows: paddle.Tensor,
    parts: Optional[List[paddle.Tensor]],
    counts: Sequence[int],
    projs: Sequence[nn.Layer],
    bases: List[QuantLinear],
    impl: str,
) -> paddle.Tensor:
    """One projection of every expert: the grouped base product plus the experts' LoRA updates over
    ``parts`` (each expert's rows, split once for the projections that share them)."""
    y = experts_linear(rows, counts, [b.quant_weight() for b in bases], impl)
    if parts is None:
        return y
    deltas = [
        p.lora_delta(part) if _adapted(p) else paddle.zeros([int(part.shape[0]), y.shape[1]], y.dtype)
        for p, part in zip(projs, parts)
    ]
    return y + paddle.concat(deltas).astype(y.dtype)


def _split(
    rows: paddle.Tensor, counts: Sequence[int], projs: Sequence[nn.Layer]
) -> Optional[List[paddle.Tensor]]:
    """Each expert's rows (one split: its backward is one concat) where a projection has an adapter."""
    return paddle.split(rows, [int(n) for n in counts]) if any(_adapted(p) for p in projs) else None


def quantised_experts(
    experts: Sequence[nn.Layer], rows: paddle.Tensor, counts: Sequence[int], swiglu: Callable[..., Any]
) -> Optional[paddle.Tensor]:
    """Every expert over its rows (``counts[e]`` each), the projections grouped; None where they are not
    every expert's bias-free QuantLinear (bare or under LoRA) of one implementation our grouped path runs."""
    projs = {name: [getattr(x, name) for x in experts] for name in PROJS}
    bases = {name: [_base(p) for p in ps] for name, ps in projs.items()}
    if not experts or any(b is None for bs in bases.values() for b in bs):
        return None
    every: List[QuantLinear] = [b for bs in bases.values() for b in bs if b is not None]
    impl = _impl(every, rows)
    if impl is None:
        return None
    full = {name: [b for b in bs if b is not None] for name, bs in bases.items()}
    parts = _split(rows, counts, [*projs["gate_proj"], *projs["up_proj"]])
    gate = _projection(rows, parts, counts, projs["gate_proj"], full["gate_proj"], impl)
    up = _projection(rows, parts, counts, projs["up_proj"], full["up_proj"], impl)
    act = swiglu(gate, up)
    down = projs["down_proj"]
    return _projection(act, _split(act, counts, down), counts, down, full["down_proj"], impl)
