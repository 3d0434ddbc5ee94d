"""The quantised linear layer (bmtrain_cli/quant/layer.py over bmtrain_cli/ops/quant_linear.py): our CPU
kernels and the reference path both equal dequantise-then-matmul, forward and input gradient, over many
shapes (odd sizes, inputs not a multiple of the block, blocks crossing rows, 3-D inputs). The dequantised
weight here is rebuilt in numpy from the formats' definitions, not from the code under test."""

from __future__ import annotations

from typing import Tuple

import numpy as np
import paddle
import pytest

from bmtrain_cli.quant import formats
from bmtrain_cli.quant.layer import QuantLinear

# (x shape, out features, block)
SHAPES = [
    ((1, 64), 16, 64),
    ((3, 70), 7, 64),
    ((2, 5, 129), 33, 64),
    ((17, 95), 40, 32),
    ((4, 300), 65, 128),  # several backward column chunks
    ((130, 257), 3, 64),  # several backward row blocks, an odd element count
    ((1, 1), 1, 64),
]
METHODS = [("nf4", False), ("nf4", True), ("int8", False), ("int4", False)]


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.int64)
    out[0::2], out[1::2] = packed >> 4, packed & 15
    return out[:n]


def numpy_dequant(q: formats.QuantizedWeight) -> np.ndarray:
    """w [out, in] in float64 from the definitions in bmtrain_cli/quant/formats.py's docstring."""
    out_f, in_f = q.shape
    n = out_f * in_f
    if q.method == "int8":
        return q.codes.astype(np.float64) * q.scales.astype(np.float64)[:, None]
    if q.method == "int4":
        codes = _unpack(q.codes, n).reshape(out_f, in_f) - 8
        group = np.arange(in_f) // q.block_size
        return codes * q.scales.astype(np.float64)[:, group]
    scales = q.scales
    if scales is None:
        blocks = np.arange(q.scale_codes.size) // formats.DOUBLE_QUANT_BLOCK
        scales = formats.dynamic_map()[q.scale_codes] * q.scale_absmax[blocks] + np.float32(q.scale_offset)
    block_of = np.arange(n) // q.block_size
    vals = formats.NF4_LEVELS[_unpack(q.codes, n)].astype(np.float64) * scales.astype(np.float64)[block_of]
    return vals.reshape(out_f, in_f)


def _case(x_shape: Tuple[int, ...], out_f: int, block: int, method: str, dq: bool, seed: int):
    rng = np.random.default_rng(seed)
    in_f = x_shape[-1]
    w = (rng.standard_normal((out_f, in_f)) * 0.1).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    dy = rng.standard_normal(x_shape[:-1] + (out_f,)).astype(np.float32)
    q = formats.quantize(w, method, block if method != "int8" else 0, dq)
    return q, x, dy


def _run(layer: QuantLinear, x: np.ndarray, dy: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    xt = paddle.to_tensor(x, stop_gradient=False)
    y = layer(xt)
    (y * paddle.to_tensor(dy)).sum().backward()
    return y.numpy(), xt.grad.numpy()


@pytest.mark.parametrize("impl", ["custom", "reference"])
@pytest.mark.parametrize("method,dq", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_equals_dequantise_then_matmul(ext, impl: str, method: str, dq: bool, shape) -> None:
    x_shape, out_f, block = shape
    q, x, dy = _case(x_shape, out_f, block, method, dq, seed=len(x_shape) * 1000 + out_f)
    w = numpy_dequant(q)
    y, dx = _run(QuantLinear(q, None, "float32", impl), x, dy)
    want_y = x.astype(np.float64) @ w.T
    want_dx = dy.astype(np.float64) @ w
    k, n = x_shape[-1], out_f
    # fp32 round-off of a k-term (forward) or n-term (backward) dot product
    tol_y = 4e-7 * np.sqrt(k) * (np.abs(x).max() * np.abs(w).max() * np.sqrt(k) + 1)
    tol_dx = 4e-7 * np.sqrt(n) * (np.abs(dy).max() * np.abs(w).max() * np.sqrt(n) + 1)
    np.testing.assert_allclose(y, want_y, rtol=0, atol=tol_y)
    np.testing.assert_allclose(dx, want_dx, rtol=0, atol=tol_dx)


@pytest.mark.parametrize("tile", [1, 100, 257])
@pytest.mark.parametrize("method,dq", METHODS)
def test_custom_in_small_tiles_equals_dequantise_then_matmul(ext, monkeypatch, tile, method, dq) -> None:
    """Tiles of a row, of a few rows and of rows starting on an odd element (an odd input count: the first
    nibble of a tile is a low one) and inside a block: the tiled product and gradient are unchanged."""
    from bmtrain_cli.ops import quant_linear as qops

    monkeypatch.setattr(qops, "TILE_ELEMENTS", tile)
    q, x, dy = _case((2, 3, 33), 21, 32, method, dq, seed=11)
    w = numpy_dequant(q)
    layer = QuantLinear(q, None, "float32", "custom")
    assert len(qops.row_tiles(layer.quant_weight())) == (21 if tile < 66 else -(-21 // (tile // 33)))
    y, dx = _run(layer, x, dy)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(dx, dy.astype(np.float64) @ w, rtol=0, atol=1e-5)


def test_custom_equals_reference_with_bias_and_no_grad_for_the_weight(ext) -> None:
    q, x, dy = _case((6, 96), 24, 32, "nf4", True, seed=7)
    bias = paddle.nn.Linear(96, 24).bias  # a Parameter, as quantize_linear hands over
    bias.set_value(paddle.to_tensor(np.linspace(-1, 1, 24).astype(np.float32)))
    bias.stop_gradient = True
    ours = QuantLinear(q, bias, "float32", "custom")
    ref = QuantLinear(q, bias, "float32", "reference")
    y1, dx1 = _run(ours, x, dy)
    y2, dx2 = _run(ref, x, dy)
    np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx1, dx2, rtol=1e-5, atol=1e-5)
    assert ours.parameters() == [bias] and all(b.stop_gradient for b in ours.buffers())
    assert list(ours.state_dict()) == ["bias"]  # the codes are not persisted


def test_dequantized_weight_is_the_paddle_layout() -> None:
    q, _, _ = _case((2, 70), 9, 64, "int4", False, seed=3)
    w = QuantLinear(q, None, "float32", "reference").dequantized_weight().numpy()
    assert w.shape == (70, 9)
    np.testing.assert_allclose(w, numpy_dequant(q).T, rtol=1e-6, atol=1e-7)


def test_custom_refuses_wrong_inputs(ext) -> None:
    q, x, _ = _case((2, 64), 8, 64, "nf4", False, seed=1)
    layer = QuantLinear(q, None, "float32", "custom")
    with pytest.raises(ValueError, match="input features"):
        layer(paddle.zeros([2, 63]))
    with pytest.raises(ValueError, match="float32"):
        layer(paddle.zeros([2, 64], dtype="float64"))


def test_auto_takes_the_tiles_on_a_cpu(ext, monkeypatch) -> None:
    from bmtrain_cli.ops import quant_linear as qops
    from bmtrain_cli.ops.build import KernelBuildError

    assert qops.choose_impl("auto", "cpu", 4, False, 64, 576) == "custom"
    assert qops.choose_impl("reference", "cpu", 4, False, 64, 576) == "reference"

    def no_compiler():
        raise KernelBuildError("no compiler")

    monkeypatch.setattr(qops, "load_extension", no_compiler)
    assert qops.choose_impl("auto", "cpu", 4, False, 64, 576) == "reference"
    with pytest.raises(KernelBuildError):
        qops.choose_impl("custom", "cpu", 4, False, 64, 576)


def test_layers_of_different_shapes_share_one_workspace(ext, monkeypatch) -> None:
    """Every tile of every layer is written into one workspace (grown to the largest tile, never
    reallocated for a smaller one): a stack of layers of different shapes, forward and backward through all
    of them, still equals dequantise-then-matmul, though each tile overwrites the last."""
    from bmtrain_cli.ops import quant_linear as qops

    monkeypatch.setattr(qops, "TILE_ELEMENTS", 2000)
    monkeypatch.setattr(qops, "_workspace", None)
    rng = np.random.default_rng(5)
    dims = [48, 80, 33, 64]
    qs = [
        formats.quantize((rng.standard_normal((o, i)) * 0.1).astype(np.float32), "nf4", 32)
        for i, o in zip(dims[:-1], dims[1:])
    ]
    layers = [QuantLinear(q, None, "float32", "custom") for q in qs]
    x = rng.standard_normal((3, dims[0])).astype(np.float32)
    xt = paddle.to_tensor(x, stop_gradient=False)
    h = xt
    for layer in layers:
        h = layer(h)
    h.sum().backward()
    ws = qops._workspace
    assert ws is not None and int(ws.shape[0]) <= 2000
    want, grad = x.astype(np.float64), np.ones((3, dims[-1]))
    dense = [numpy_dequant(q) for q in qs]
    for w in dense:
        want = want @ w.T
    for w in reversed(dense):
        grad = grad @ w
    np.testing.assert_allclose(h.numpy(), want, rtol=0, atol=1e-4)
    np.testing.assert_allclose(xt.grad.numpy(), grad, rtol=0, atol=1e-4)
    layers[-1](paddle.to_tensor(rng.standard_normal((2, dims[-2])).astype(np.float32)))
    assert qops._workspace is ws  # a smaller tile reuses it
