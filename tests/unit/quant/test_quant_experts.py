"""The routed experts of an MoE layer with a quantised base run as grouped calls (ops/quant_experts.py,
quant/experts.py): our C++ launcher's grouped product and its input gradient equal, to fp32 round-off,
dequantising every expert's weight and running the reference composition (one expert at a time), over
nf4 (with and without double quant), int8 and int4, odd shapes, experts without tokens, and shapes large
enough for the threaded path; LoRA on the experts adds each expert's update."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from bmtrain_cli.ops import quant_linear as qops
from bmtrain_cli.ops.moe_experts import reference_experts, swiglu_expert
from bmtrain_cli.ops.quant_experts import experts_linear, grouped_linear
from bmtrain_cli.quant import formats
from bmtrain_cli.quant.experts import quantised_experts
from bmtrain_cli.quant.layer import QuantLinear

FORMATS = [("nf4", 16, False), ("nf4", 64, True), ("int8", 0, False), ("int4", 16, False)]


def _quant(rng, method, block, double, out_f, in_f, impl="custom"):
    w = rng.standard_normal((out_f, in_f)).astype(np.float32) * 0.3
    q = formats.quantize(w, method, block or in_f, double)
    return QuantLinear(q, None, "float32", impl)


def _dequant(layer):
    return qops.dequantize(layer.quant_weight())  # [out, in]


def _swiglu(g, u):
    return F.silu(g) * u


@pytest.mark.parametrize("method, block, double", FORMATS)
@pytest.mark.parametrize(
    "n, k, counts", [(37, 29, [5, 0, 7, 1, 0]), (130, 110, [0, 300, 20]), (300, 211, [3, 0, 5])]
)
def test_grouped_linear_equals_dequantise_then_matmul(method, block, double, n, k, counts):
    """(130 x 110 x 320 rows is over the launcher's threading threshold: the OpenMP path runs. A 300 x 211
    weight is over the launcher's 32Ki-weight tile: each expert's weight spans several blocks, of 155 rows
    forward and 109 columns for the input gradient, which start inside a group and on odd nibbles.)"""
    rng = np.random.default_rng(n + k)
    layers = [_quant(rng, method, block, double, n, k) for _ in counts]
    x = rng.standard_normal((sum(counts), k)).astype(np.float32)
    dy = rng.standard_normal((sum(counts), n)).astype(np.float32)
    rows = paddle.to_tensor(x, stop_gradient=False)
    y = grouped_linear(rows, counts, [m.quant_weight() for m in layers])
    (y * paddle.to_tensor(dy)).sum().backward()
    want_y, want_dx, start = [], [], 0
    for m, c in zip(layers, counts):
        w = _dequant(m).numpy().astype(np.float64)
        want_y.append(x[start : start + c] @ w.T)
        want_dx.append(dy[start : start + c] @ w)
        start += c
    np.testing.assert_allclose(y.numpy(), np.concatenate(want_y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rows.grad.numpy(), np.concatenate(want_dx), rtol=1e-5, atol=1e-5)
    assert np.abs(rows.grad.numpy()).max() > 0.1


@pytest.mark.parametrize("method, block, double", FORMATS)
def test_quantised_experts_equal_the_dequantised_reference_composition(method, block, double):
    rng = np.random.default_rng(7)
    h, f, counts = 24, 19, [3, 0, 9, 4]
    experts = [
        SimpleNamespace(
            gate_proj=_quant(rng, method, block, double, f, h),
            up_proj=_quant(rng, method, block, double, f, h),
            down_proj=_quant(rng, method, block, double, h, f),
        )
        for _ in counts
    ]
    x = rng.standard_normal((sum(counts), h)).astype(np.float32)
    dy = paddle.to_tensor(rng.standard_normal((sum(counts), h)).astype(np.float32))

    def run(fn):
        rows = paddle.to_tensor(x, stop_gradient=False)
        y = fn(rows)
        (y * dy).sum().backward()
        return y.numpy(), rows.grad.numpy()

    got = run(lambda r: quantised_experts(experts, r, counts, _swiglu))
    fns = [
        swiglu_expert(*(_dequant(getattr(e, p)).t() for p in ("gate_proj", "up_proj", "down_proj")))
        for e in experts
    ]
    want = run(lambda r: reference_experts(r, counts, fns))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
    assert np.abs(got[1]).max() > 1e-3
    # the reference implementation of the grouped calls computes the same
    for e in experts:
        for p in ("gate_proj", "up_proj", "down_proj"):
            getattr(e, p).impl = "reference"
    np.testing.assert_allclose(
        run(lambda r: quantised_experts(experts, r, counts, _swiglu))[1], want[1], rtol=1e-5, atol=1e-6
    )


def test_lora_on_the_quantised_experts_adds_each_experts_update():
    rng = np.random.default_rng(3)
    h, f, counts = 16, 12, [4, 0, 5]

    class Adapted:
        def __init__(self, base):
            self.base_layer, self.adapter_enabled, self.tp_kind, self._parameters = base, True, None, {}
            self.a = paddle.to_tensor(rng.standard_normal((base.in_features, 2)).astype(np.float32))
            self.b = paddle.to_tensor(rng.standard_normal((2, base.out_features)).astype(np.float32))

        def lora_delta(self, x):
            return paddle.matmul(paddle.matmul(x, self.a), self.b) * 0.5

        def __call__(self, x):
            return self.base_layer(x) + self.lora_delta(x)

    experts = [
        SimpleNamespace(
            gate_proj=Adapted(_quant(rng, "nf4", 16, False, f, h)),
            up_proj=Adapted(_quant(rng, "nf4", 16, False, f, h)),
            down_proj=Adapted(_quant(rng, "nf4", 16, False, h, f)),
        )
        for _ in counts
    ]
    x = paddle.to_tensor(rng.standard_normal((sum(counts), h)).astype(np.float32))
    got = quantised_experts(experts, x, counts, _swiglu)
    want = reference_experts(
        x, counts, [lambda r, e=e: e.down_proj(_swiglu(e.gate_proj(r), e.up_proj(r))) for e in experts]
    )
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


def test_unquantised_or_mixed_experts_are_left_to_the_layer():
    rng = np.random.default_rng(0)
    q = _quant(rng, "int8", 0, False, 8, 8)
    mixed = [SimpleNamespace(gate_proj=q, up_proj=q, down_proj=paddle.nn.Linear(8, 8, bias_attr=False))]
    assert quantised_experts(mixed, paddle.zeros([2, 8]), [2], _swiglu) is None
    with pytest.raises(ValueError, match="differ in layout"):
        experts_linear(
            paddle.zeros([2, 8]),
            [1, 1],
            [q.quant_weight(), _quant(rng, "int4", 4, False, 8, 8).quant_weight()],
            "custom",
        )
