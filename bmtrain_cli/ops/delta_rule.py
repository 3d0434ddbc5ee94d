"""The gated delta rule (Gated DeltaNet, models/linear_attention.py) on our CPU kernel: a checked wrapper
over the custom operators bmt_delta_rule_fwd / _bwd (kernels/paddle/delta_rule_op.cc ->
kernels/cpu/delta_rule_cpu.cc) and its autograd, with the Paddle-op rule of ops/reference.py as the
fallback.

The kernel runs the recurrence token by token per (batch, head), from a zero state, float32 or float64 on
a CPU; it keeps the state before every chunk of ``chunk`` tokens for its backward, which recomputes one
chunk at a time. Anything else (a given initial state: generation continuing from the cache; another
dtype or device, a paddle.jit.to_static trace) takes :func:`bmtrain_cli.ops.reference.gated_delta_rule`. The op set carries it as
``OpSet.delta_rule`` where our kernels run on a CPU (kernels ``custom``, or ``auto`` with the extension
built)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops import reference
from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.custom import _traced as traced
from bmtrain_cli.ops.custom import contiguous

_DTYPES = (paddle.float32, paddle.float64)
T = paddle.Tensor


class _DeltaRule(PyLayer):
    @staticmethod
    def forward(ctx: Any, q: T, k: T, v: T, g: T, beta: T, chunk: int) -> Tuple[T, T]:
        out, states, final = load_extension().bmt_delta_rule_fwd(q, k, v, g, beta, chunk)
        ctx.save_for_backward(q, k, v, g, beta, states)
        ctx.chunk = chunk
        return out, final

    @staticmethod
    def backward(
        ctx: Any, dout: Optional[paddle.Tensor], dfinal: Optional[paddle.Tensor]
    ) -> Tuple[paddle.Tensor, ...]:
        q, k, v, g, beta, states = ctx.saved_tensor()
        b, _, h, dk = q.shape
        dout = paddle.zeros([*q.shape[:3], v.shape[-1]], q.dtype) if dout is None else contiguous(dout)
        dfinal = paddle.zeros([b, h, dk, v.shape[-1]], q.dtype) if dfinal is None else contiguous(dfinal)
        return tuple(load_extension().bmt_delta_rule_bwd(q, k, v, g, beta, states, dout, dfinal, ctx.chunk))


def _kernel_takes(tensors: Tuple[paddle.Tensor, ...], state: Optional[paddle.Tensor]) -> bool:
    if traced():  # a to_static graph (the Paddle Inference export) keeps the Paddle-op rule
        return False
    dtype = tensors[0].dtype
    return (
        state is None
        and dtype in _DTYPES
        and all(t.dtype == dtype and t.place.is_cpu_place() for t in tensors)
        and int(tensors[0].shape[1]) > 0
    )


def gated_delta_rule(
    q: T, k: T, v: T, g: T, beta: T, state: Optional[T] = None, chunk: int = 64
) -> Tuple[T, T]:
    """:func:`bmtrain_cli.ops.reference.gated_delta_rule`'s signature and results (output [b, s, h, dv],
    final state [b, h, dk, dv]); our kernel where it applies (see the module docstring)."""
    tensors = (q, k, v, g, beta)
    if not _kernel_takes(tensors, state):
        return reference.gated_delta_rule(q, k, v, g, beta, state, chunk)
    q, k, v, g, beta = (contiguous(t) for t in tensors)
    if paddle.is_grad_enabled() and not all(t.stop_gradient for t in (q, k, v, g, beta)):
        out, final = _DeltaRule.apply(q, k, v, g, beta, chunk)
        return out, final
    out, _, final = load_extension().bmt_delta_rule_fwd(q, k, v, g, beta, chunk)
    return out, final
