"""The quantised linear layer's product, y = x @ dequant(w)^T, and its gradient with respect to x (the
weight is frozen: no gradient), in three implementations chosen by ``model_config.kernels``:

* ``custom``: tiles of rows of the weight, each dequantised by our C++/OpenMP launcher
  (kernels/cpu/quant_cpu.cc through the Paddle operator of kernels/paddle/quant_op.cc) and multiplied at
  once with Paddle's matmul (MKL on a CPU): y[..., r0:r1] = x @ tile^T forward, dx += dy[..., r0:r1] @ tile
  backward. A tile holds at most :data:`TILE_ELEMENTS` weights, so the per-step path never holds a layer's
  whole dequantised weight, however large the layer; every tile of every layer is written into one
  workspace of the process, reused (no allocation and no fresh pages per tile). fp32 on a CPU.
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
from typing import Any, List, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops.build import KernelBuildError, load_extension
from bmtrain_cli.ops.quant_tiles import TILE_ELEMENTS

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


def row_tiles(w: QuantWeight) -> List[Tuple[int, int]]:
    """(r0, r1) of the tiles of the custom path: whole rows, at most TILE_ELEMENTS weights (one row at least)."""
    rows = max(1, min(w.out_features, TILE_ELEMENTS // max(1, w.in_features)))
    return [(r, min(w.out_features, r + rows)) for r in range(0, w.out_features, rows)]


_workspace: Optional[paddle.Tensor] = None  # the tiles' fp32 workspace, grown to the largest tile yet


def _tile(w: QuantWeight, r0: int, r1: int) -> paddle.Tensor:
    """Rows r0..r1 of the weight in fp32, dequantised by the C++ launcher into the workspace: a view that
    the next tile overwrites, so each is used (by one matmul) before the next is made."""
    global _workspace
    size = (r1 - r0) * w.in_features
    if _workspace is None or int(_workspace.shape[0]) < size:
        _workspace = paddle.empty([size], dtype="float32")
    load_extension().bmt_quant_dequant_rows_(
        w.codes,
        w.levels,
        w.scales,
        _workspace,
        w.bits,
        w.block,
        int(w.row_groups),
        w.out_features,
        w.in_features,
        r0,
        r1,
    )
    return _workspace[:size].reshape([r1 - r0, w.in_features])


def _tiled_forward(x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
    parts = [paddle.matmul(x, _tile(w, r0, r1), transpose_y=True) for r0, r1 in row_tiles(w)]
    return parts[0] if len(parts) == 1 else paddle.concat(parts, axis=-1)


def _tiled_backward(dy: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
    tiles = row_tiles(w)
    if len(tiles) == 1:
        return paddle.matmul(dy, _tile(w, 0, w.out_features))
    (r0, r1), rest = tiles[0], tiles[1:]
    dx = paddle.matmul(dy[..., r0:r1], _tile(w, r0, r1))
    for r0, r1 in rest:
        dx.add_(paddle.matmul(dy[..., r0:r1], _tile(w, r0, r1)))
    return dx


class _CustomQuantLinear(PyLayer):
    @staticmethod
    def forward(ctx: Any, x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
        ctx.w = w
        return _tiled_forward(x, w)

    @staticmethod
    def backward(ctx: Any, dy: paddle.Tensor) -> paddle.Tensor:
        return _tiled_backward(dy, ctx.w)


def _check(x: paddle.Tensor, w: QuantWeight) -> None:
    if x.ndim < 1 or int(x.shape[-1]) != w.in_features:
        raise ValueError(
            f"quant_linear: x {list(x.shape)} does not end in the weight's {w.in_features} input features"
        )


def custom_linear(x: paddle.Tensor, w: QuantWeight) -> paddle.Tensor:
    """Tiles dequantised by our C++ launcher, each multiplied by Paddle's matmul (fp32 on a CPU); the
    gradient flows to x only."""
    _check(x, w)
    if x.dtype != paddle.float32 or not x.place.is_cpu_place():
        raise ValueError(f"quant_linear: the CPU kernels take float32 on a CPU, got {x.dtype} on {x.place}")
    if paddle.is_grad_enabled() and not x.stop_gradient:
        return _CustomQuantLinear.apply(x, w)
    return _tiled_forward(x, w)


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
    ``custom``: the tiles of our CPU launcher (KernelBuildError where they cannot run). ``auto``: on a CPU
    the same where the kernels build (else the reference); on a GPU Paddle's weight-only kernels where they
    cover the format, else the reference."""
    if mode == "reference":
        return "reference"
    on_cpu = device.startswith("cpu")
    if mode == "custom":
        if not on_cpu:
            raise KernelBuildError(f"the quantised linear kernels run on a CPU; the device is {device}")
        load_extension()
        return "custom"
    if on_cpu and mode == "auto":
        try:
            load_extension()
        except KernelBuildError:
            return "reference"
        return "custom"
    if not on_cpu and weight_only_supported(bits, row_groups, block, in_features):
        return "weight_only"
    return "reference"
