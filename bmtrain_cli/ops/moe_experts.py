"""The routed SwiGLU experts of an MoE layer over rows sorted by expert (models/moe.py): expert e takes the
``counts[e]`` rows after those of the experts before it and returns ``(silu(x gate_e) * x up_e) down_e``
for each, weights in Paddle's [in, out] layout. Two implementations, chosen by :func:`choose`:

* ``grouped``: one grouped GEMM on a CPU (kernels/cpu/moe_cpu.cc through the operators of
  kernels/paddle/moe_op.cc), fp32: every expert's gate/up, SwiGLU and down in one call, forward and
  backward (the rows' and every expert's weight gradients), OpenMP over (expert, tile) blocks, MKL's sgemm
  inside. It keeps the gate/up pre-activations [rows, 2f] for the backward, less than the reference.
* ``reference``: a Python loop over the experts with Paddle's matmuls (any device and dtype).

An expert without rows gets zero gradients in both (not missing ones), so every data-parallel rank reduces
the same gradients and the optimizer sees them all.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from bmtrain_cli.errors import NoticeWarning
from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.custom import contiguous

IMPLS = ("grouped", "reference")
Weights = Tuple[Sequence[paddle.Tensor], Sequence[paddle.Tensor], Sequence[paddle.Tensor]]


def reference_experts(
    rows: paddle.Tensor, counts: Sequence[int], experts: Sequence[Callable[[paddle.Tensor], paddle.Tensor]]
) -> paddle.Tensor:
    """Expert by expert: ``experts[e]`` (a layer, or :func:`swiglu_expert`) over its rows, in Paddle ops
    (an expert without rows runs on zero rows: zero gradients)."""
    outs: List[paddle.Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        outs.append(experts[e](rows[start : start + n]))
        start += n
    return paddle.concat(outs)


def swiglu_expert(
    gate: paddle.Tensor, up: paddle.Tensor, down: paddle.Tensor
) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """One expert's ``(silu(x gate) * x up) down`` in Paddle ops, for :func:`reference_experts`."""
    return lambda x: paddle.matmul(F.silu(paddle.matmul(x, gate)) * paddle.matmul(x, up), down)


class _Grouped(PyLayer):
    @staticmethod
    def forward(ctx: Any, rows: paddle.Tensor, counts: List[int], *weights: paddle.Tensor) -> paddle.Tensor:
        e = len(counts)
        gate, up, down = list(weights[:e]), list(weights[e : 2 * e]), list(weights[2 * e :])
        y, gate_up = load_extension().bmt_moe_swiglu_fwd(rows, gate, up, down, counts)
        ctx.save_for_backward(rows, gate_up, *weights)
        ctx.counts = counts
        return y

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: None for the inputs that need no gradient
        ctx: Any, dy: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        rows, gate_up, *weights = ctx.saved_tensor()
        e = len(ctx.counts)
        gate, up, down = weights[:e], weights[e : 2 * e], weights[2 * e :]
        ext, dy = load_extension(), contiguous(dy)
        if all(w.stop_gradient for w in weights):  # frozen experts: the input gradient only
            return (
                ext.bmt_moe_swiglu_dx(rows, gate, up, down, gate_up, dy, ctx.counts),
                *[None] * len(weights),
            )
        dw = [paddle.empty(w.shape, w.dtype) for w in weights]
        out = ext.bmt_moe_swiglu_bwd(
            rows, gate, up, down, gate_up, dy, dw[:e], dw[e : 2 * e], dw[2 * e :], ctx.counts
        )
        dx = out[0] if isinstance(out, (list, tuple)) else out
        # Paddle wants None for an input that needs no gradient
        return (
            None if rows.stop_gradient else dx,
            *(None if w.stop_gradient else g for w, g in zip(weights, dw)),
        )


def grouped_experts(rows: paddle.Tensor, counts: Sequence[int], weights: Weights) -> paddle.Tensor:
    """Our CPU grouped GEMM (float32 on a CPU; a ValueError otherwise)."""
    gate, up, down = weights
    dtypes = {rows.dtype, *(w.dtype for w in (*gate, *up, *down))}
    if dtypes != {paddle.float32} or not rows.place.is_cpu_place():
        raise ValueError(
            f"moe experts: the grouped GEMM takes float32 on a CPU, got {dtypes} on {rows.place}"
        )
    if not len(counts) == len(gate) == len(up) == len(down):
        raise ValueError(f"moe experts: {len(counts)} counts for {len(gate)}/{len(up)}/{len(down)} weights")
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"moe experts: the counts sum to {sum(counts)}, the rows are {rows.shape[0]}")
    rows, flat = contiguous(rows), [contiguous(w) for w in (*gate, *up, *down)]
    needs_grad = not rows.stop_gradient or any(not w.stop_gradient for w in flat)
    if paddle.is_grad_enabled() and needs_grad:
        return _Grouped.apply(rows, [int(n) for n in counts], *flat)
    return load_extension().bmt_moe_swiglu_fwd(
        rows, list(gate), list(up), list(down), [int(n) for n in counts]
    )[0]


_told: Set[str] = set()


def choose(mode: str, device: str, ours_built: bool) -> Tuple[str, str]:
    """(implementation, why) for ``model_config.kernels`` on ``device``; ``ours_built``: whether our
    extension loaded. On a CPU our grouped GEMM wherever our kernels run (``custom``, ``auto`` with the
    extension built). On a GPU the reference: Paddle 3.x has no grouped-GEMM MoE op that trains
    (``paddle.incubate.nn.functional.fused_moe`` is forward-only, SM75-86, with its own softmax router) and
    our CUDA kernels have no grouped GEMM."""
    if mode == "reference":
        return "reference", "kernels: reference"
    if not device.startswith("cpu"):
        return "reference", (
            f"no grouped-GEMM training op for the MoE experts on {device} (Paddle's fused_moe is "
            "inference-only): the experts run one matmul chain each"
        )
    if mode in ("custom", "auto") and ours_built:
        return "grouped", "our CPU grouped GEMM (kernels/cpu/moe_cpu.cc)"
    return "reference", f"kernels: {mode} without our CPU kernels"


def resolve(grouped: Optional[Callable], mode: str, device: str) -> Optional[Callable]:
    """What an MoE layer runs its experts with: ``grouped`` (``OpSet.moe_experts``) where set, else None
    (the reference composition); says once per process and reason when a GPU runs the reference."""
    if grouped is not None:
        return grouped
    why = choose(mode, device, ours_built=False)[1]
    if not device.startswith("cpu") and why not in _told:
        _told.add(why)
        warnings.warn(f"MoE experts: {why}", NoticeWarning, stacklevel=3)
    return None
