"""The quantised linear layer's product, y = x @ dequant(w)^T, and its gradient with respect to x (the
weight is frozen: no gradient), in three implementations chosen by ``model_config.kernels``:

* ``custom``: the C++/OpenMP kernels (kernels/cpu/quant_cpu.cc through the Paddle operators of
  kernels/paddle/quant_op.cc), fp32 on a CPU. They dequantise the weight tile by tile into per-thread
  buffers, so the per-step path never holds the layer's whole dequantised weight.
* ``reference``: :func:`dequantize` then a matmul, in Paddle ops (any device; it materialises the
  dequantised weight of one layer for the matmul and again in the backward, one layer at a time).
* ``weight_only``: on a GPU, Paddle's ``paddle.nn.quant.weight_only_linear`` for int8 and int4 (int4 with
  groups of 64 or 128): the dequantised weight is re-quantised once into Paddle's own layout
  (``weight_quantize``), which reproduces our grid (the same max-abs scales). No GPU Paddle runs where this
  package is tested, so this path is written but untested; nf4 on a GPU runs ``reference``.

A weight is described by :class:`QuantWeight` (bmtrain_cli/quant/layer.py builds it from the formats of
bmtrain_cli/quant/formats.py): element e = r * k + c of w [n, k] is ``levels[code(e)] * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops.build import KernelBuildError, load_extension
from bmtrain_cli.ops.custom import contiguous

IMPLS = ("custom", "reference", "weight_only")


@dataclass(frozen=True)
class QuantWeight:
    """The tensors and layout of one quantised weight w [n, k] (see the module docstring): ``codes``
    uint8 (one byte per element at 8 bits, two nibbles per byte at 4), ``levels`` fp32 [2^bits],
    ``scales`` fp32 (per block of the flattened weight, or per group of each row with row_groups)."""

    codes: paddle.Tensor
    levels: paddle.Tensor
    scales: paddle.Tensor
    bits: int
    block: int
    row_groups: bool
    out_features: int
    in_features: int

    def attrs(self, features: int) -> Tuple[int, int, int, int]:
        return self.bits, self.block, int(self.row_groups), features


def dequantize(w: QuantWeight) -> paddle.Tensor:
    """The weight [n, k] in fp32 (the reference path, the GPU paths and merging)."""
    n, k = w.out_features, w.in_features
    codes = w.codes.astype("int64")
    if w.bits == 4:
        codes = paddle.stack([codes // 16, codes % 16], axis=-1).reshape([-1])[: n * k]
    vals = paddle.gather(w.levels, codes)
    if w.row_groups:
        groups = -(-k // w.block)
        col_group = paddle.arange(k, dtype="int64") // w.block
        scale = paddle.gather(w.scales.reshape([n, groups]), col_group, axis=1)
        return vals.reshape([n, k]) * scale
    block_of = paddle.arange(n * k, dtype="int64") // w.block
    return (vals * paddle.gather(w.scales.reshape([-1]), block_of)).reshape([n, k])


class _CustomQuantLinear(PyLayer):
    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
        ctx.w = w
        return load_extension().bmt_quant_linear_fwd(x, w.codes, w.levels, w.scales, *w.attrs(w.out_features))

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        w = ctx.w
        return load_extension().bmt_quant_linear_bwd(
            contiguous(dy), w.codes, w.levels, w.scales, *w.attrs(w.in_features)
        )


def _check(x: paddle.Tensor, w: QuantWeight) -> None:
    if x.ndim < 1 or int(x.shape[-1]) != w.in_features:
        raise ValueError(
            f"quant_linear: x {list(x.shape)} does not end in the weight's {w.in_features} input features"
        )


def custom_linear(x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
    """Our CPU kernels (fp32); the gradient flows to x only."""
    _check(x, w)
    if x.dtype != paddle.float32 or not x.place.is_cpu_place():
        raise ValueError(f"quant_linear: the CPU kernels take float32 on a CPU, got {x.dtype} on {x.place}")
    x = contiguous(x)
    if paddle.is_grad_enabled() and not x.stop_gradient:
        return _CustomQuantLinear.apply(x, w)
    return load_extension().bmt_quant_linear_fwd(x, w.codes, w.levels, w.scales, *w.attrs(w.out_features))


class _ReferenceQuantLinear(PyLayer):
    """Dequantise in the forward, multiply, drop the weight; dequantise again in the backward: one
    layer's dequantised weight is alive at a time (autograd would keep every layer's until the backward)."""

    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
        ctx.w = w
        return paddle.matmul(x, dequantize(w).astype(x.dtype), transpose_y=True)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(dy, dequantize(ctx.w).astype(dy.dtype))


def reference_linear(x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
    """Dequantise, then matmul (the weight's tensors carry no gradient)."""
    _check(x, w)
    if paddle.is_grad_enabled() and not x.stop_gradient:
        return _ReferenceQuantLinear.apply(x, w)
    return paddle.matmul(x, dequantize(w).astype(x.dtype), transpose_y=True)


def weight_only_supported(bits: int, row_groups: bool, block: int, in_features: int) -> bool:
    """Whether Paddle's weight_only_linear covers the format: int8 per channel, int4 in groups of 64/128."""
    if not hasattr(paddle.nn.quant, "weight_only_linear"):
        return False
    per_channel = row_groups and block >= in_features
    return (bits == 8 and per_channel) or (bits == 4 and row_groups and block in (64, 128))


def to_weight_only(w: QuantWeight, dtype: Any) -> Tuple[paddle.Tensor, paddle.Tensor, Any, Any]:
    """(weight, scale, weight_dtype, group_size) in Paddle's weight-only layout, made once per layer."""
    group: Any = -1 if w.block >= w.in_features else w.block
    kind: Any = "int8" if w.bits == 8 else "int4"
    algo: Any = f"weight_only_{kind}"
    weight = dequantize(w).astype(dtype).t()  # [k, n], as weight_quantize expects
    q, scale = paddle.nn.quant.weight_quantize(weight, algo=algo, group_size=group)
    return q, scale, kind, group


def weight_only_linear(
    x: paddle.Tensor, packed: Tuple[paddle.Tensor, paddle.Tensor, Any, Any]
) -> paddle.Tensor:
    q, scale, kind, group = packed
    return paddle.nn.quant.weight_only_linear(x, q, weight_scale=scale, weight_dtype=kind, group_size=group)


def choose_impl(mode: str, device: str, bits: int, row_groups: bool, block: int, in_features: int) -> str:
    """The implementation for ``model_config.kernels`` (auto, custom, paddle, reference) on ``device``.
    ``custom``: our CPU kernels (KernelBuildError where they cannot run). ``auto``: on a CPU the reference,
    which multiplies with Paddle's (MKL) matmul and was measured faster per training step than our
    kernels (benchmarks/bench_qlora.py) while holding one layer's dequantised weight at a time; on a GPU Paddle's
    weight-only kernels where they cover the format, else the reference."""
    if mode == "reference":
        return "reference"
    on_cpu = device.startswith("cpu")
    if mode == "custom":
        if not on_cpu:
            raise KernelBuildError(f"the quantised linear kernels run on a CPU; the device is {device}")
        load_extension()
        return "custom"
    if not on_cpu and weight_only_supported(bits, row_groups, block, in_features):
        return "weight_only"
    return "reference"
