"""One projection of every routed expert of an MoE layer whose base is quantised (bmtrain_cli/quant/experts.py):
over rows sorted by expert (``counts[e]`` rows each), ``y[rows of e] = x[rows of e] @ dequant(W_e)^T``, and
its gradient with respect to the rows only (the base is frozen). Two implementations:

* ``custom``: one call of our C++/OpenMP launcher for all the experts (kernels/cpu/quant_cpu.cc through the
  operators of kernels/paddle/quant_op.cc), fp32 on a CPU: blocks of (expert, piece of its weight), each
  piece (at most 32Ki weights) dequantised into its thread's tile and multiplied over the expert's rows
  with sgemm; no expert's whole weight is dequantised, and an expert without rows costs nothing.
* ``reference``: expert by expert, dequantise then matmul (:func:`ops.quant_linear.reference_linear`), in
  Paddle ops on any device.

Every expert's weight has one layout (method, block, shape): an MoE layer's experts are quantised alike.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.custom import contiguous
from bmtrain_cli.ops.quant_linear import QuantWeight, reference_linear

IMPLS = ("custom", "reference")


def _layout(weights: Sequence[QuantWeight]) -> Tuple[int, int, int, int, int]:
    """(bits, block, row_groups, n, k) shared by every expert's weight (a ValueError where they differ)."""
    layouts = {(w.bits, w.block, int(w.row_groups), w.out_features, w.in_features) for w in weights}
    if len(layouts) != 1:
        raise ValueError(f"quant experts: the experts' weights differ in layout: {sorted(layouts)}")
    return layouts.pop()


def _args(counts: Sequence[int], weights: Sequence[QuantWeight]) -> List[Any]:
    """The operators' inputs after x: codes, scales, levels, counts and the layout."""
    codes = [w.codes for w in weights]
    scales = [contiguous(w.scales) for w in weights]
    return [codes, scales, weights[0].levels, [int(n) for n in counts], *_layout(weights)]


def _single(out: Any) -> paddle.Tensor:
    return out[0] if isinstance(out, (list, tuple)) else out


class _GroupedQuant(PyLayer):
    @staticmethod
    def forward(ctx: Any, rows: paddle.Tensor, args: List[Any]) -> paddle.Tensor:
        ctx.args = args
        return _single(load_extension().bmt_quant_grouped_fwd(rows, *args))

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        return _single(load_extension().bmt_quant_grouped_dx(contiguous(dy), *ctx.args))


def _check(rows: paddle.Tensor, counts: Sequence[int], weights: Sequence[QuantWeight]) -> None:
    if len(counts) != len(weights) or not weights:
        raise ValueError(f"quant experts: {len(counts)} counts for {len(weights)} weights")
    if rows.ndim != 2 or int(rows.shape[1]) != weights[0].in_features:
        raise ValueError(f"quant experts: rows {list(rows.shape)} are not [rows, {weights[0].in_features}]")
    if sum(int(n) for n in counts) != int(rows.shape[0]):
        raise ValueError(f"quant experts: the counts sum to {sum(counts)}, the rows are {rows.shape[0]}")


def grouped_linear(
    rows: paddle.Tensor, counts: Sequence[int], weights: Sequence[QuantWeight]
) -> paddle.Tensor:
    """Our C++ launcher, one call for all the experts (float32 on a CPU; a ValueError otherwise); the
    gradient flows to ``rows`` only."""
    _check(rows, counts, weights)
    if rows.dtype != paddle.float32 or not rows.place.is_cpu_place():
        raise ValueError(
            f"quant experts: the CPU kernels take float32 on a CPU, got {rows.dtype} on {rows.place}"
        )
    rows, args = contiguous(rows), _args(counts, weights)
    if paddle.is_grad_enabled() and not rows.stop_gradient:
        return _GroupedQuant.apply(rows, args)
    return _single(load_extension().bmt_quant_grouped_fwd(rows, *args))


def reference_grouped_linear(
    rows: paddle.Tensor, counts: Sequence[int], weights: Sequence[QuantWeight]
) -> paddle.Tensor:
    """Expert by expert: dequantise, then matmul (an expert without rows runs on zero rows)."""
    _check(rows, counts, weights)
    outs, start = [], 0
    for w, n in zip(weights, counts):
        outs.append(reference_linear(rows[start : start + int(n)], w))
        start += int(n)
    return paddle.concat(outs)


def experts_linear(
    rows: paddle.Tensor, counts: Sequence[int], weights: Sequence[QuantWeight], impl: str
) -> paddle.Tensor:
    """:func:`grouped_linear` (``custom``) or :func:`reference_grouped_linear` (``reference``)."""
    if impl == "custom":
        return grouped_linear(rows, counts, weights)
    if impl == "reference":
        return reference_grouped_linear(rows, counts, weights)
    raise ValueError(f"quant experts: unknown implementation {impl!r} ({', '.join(IMPLS)})")
