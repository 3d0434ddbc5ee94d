"""Weight-only INT8 maths on plain Paddle layers."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.export.quantize import (
    QuantEmbedding,
    QuantLinear,
    dequantize_array,
    quantize_array,
    quantize_model,
)


def test_per_output_channel_symmetric_scales():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(48, 16)).astype(np.float32) * np.linspace(0.01, 3.0, 16, dtype=np.float32)
    w[:, 3] = 0.0
    q, s = quantize_array(w, axis=1)
    assert q.dtype == np.int8 and q.shape == w.shape and s.shape == (16,) and s.dtype == np.float32
    np.testing.assert_allclose(
        s[np.arange(16) != 3], np.abs(w).max(axis=0)[np.arange(16) != 3] / 127, rtol=1e-6
    )
    assert np.all(np.abs(q).max(axis=0)[np.arange(16) != 3] == 127)  # each channel's extreme maps to +-127
    assert np.all(q[:, 3] == 0)
    err = np.abs(dequantize_array(q, s, axis=1) - w)
    assert np.all(err <= s[None, :] / 2 + 1e-7)  # round to nearest: at most half a step per channel
    q0, s0 = quantize_array(w.T, axis=0)  # rows as channels (embeddings / HF layout) give the same numbers
    np.testing.assert_array_equal(q0, q.T)
    np.testing.assert_array_equal(s0, s)


def test_quant_linear_is_exactly_the_dequantised_matmul():
    paddle.seed(1)
    lin = paddle.nn.Linear(32, 24)
    ql = QuantLinear.from_linear(lin)
    x = paddle.randn([3, 5, 32])
    q, s = quantize_array(lin.weight.numpy(), axis=1)
    ref = x.numpy() @ dequantize_array(q, s, axis=1) + lin.bias.numpy()
    np.testing.assert_allclose(ql(x).numpy(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ql.qweight.numpy(), q)
    assert ql.qweight.dtype == paddle.int8


def test_kernel_mode_always_refuses_without_gpu_kernel():
    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        pytest.skip("a GPU is present: the kernel path is exercised instead")
    ql = QuantLinear.from_linear(paddle.nn.Linear(8, 8), use_kernel="always")
    with pytest.raises(RuntimeError, match="weight_only_linear needs a supported GPU"):
        ql(paddle.randn([2, 8]))


@pytest.mark.skipif(
    not (paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0), reason="needs a GPU"
)
def test_gpu_weight_only_linear_matches_fallback():
    paddle.seed(2)
    lin = paddle.nn.Linear(256, 128)
    ql = QuantLinear.from_linear(lin, use_kernel="always")
    x = paddle.randn([4, 256]).astype("float16")
    fallback = paddle.matmul(x.astype("float32"), ql.weight) + lin.bias
    np.testing.assert_allclose(ql(x).astype("float32").numpy(), fallback.numpy(), rtol=2e-2, atol=2e-2)


def test_quant_embedding_rows():
    paddle.seed(3)
    emb = paddle.nn.Embedding(40, 16)
    qe = QuantEmbedding.from_embedding(emb)
    ids = paddle.to_tensor([[0, 5, 39], [7, 7, 1]])
    q, s = quantize_array(emb.weight.numpy(), axis=0)
    table = dequantize_array(q, s, axis=0)
    np.testing.assert_allclose(qe(ids).numpy(), table[ids.numpy()], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(qe.weight.numpy(), table, rtol=1e-6, atol=1e-7)


class _Toy(paddle.nn.Layer):
    def __init__(self, vocab: int = 64, hidden: int = 64, inner: int = 256):
        super().__init__()
        self.embed = paddle.nn.Embedding(vocab, hidden)
        self.up = paddle.nn.Linear(hidden, inner)
        self.down = paddle.nn.Linear(inner, hidden, bias_attr=False)
        self.norm = paddle.nn.LayerNorm(hidden)
        self.head = paddle.nn.Linear(hidden, vocab, bias_attr=False)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.norm(x + self.down(paddle.nn.functional.silu(self.up(x)))))


def test_quantize_model_replaces_layers_and_reports_size():
    paddle.seed(4)
    model = _Toy()
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 64, (2, 9)))
    before = model(ids).numpy()
    report = quantize_model(model)
    assert report.linear == ["up", "down", "head"] and report.embedding == ["embed"]
    assert isinstance(model.up, QuantLinear) and isinstance(model.embed, QuantEmbedding)
    assert isinstance(model.norm, paddle.nn.LayerNorm)
    # linear-dominated: int8 weights + fp32 scales/biases/norms come to about a quarter of fp32
    assert report.ratio <= 0.3, report.ratio
    assert report.ratio > 0.25  # int8 is 1/4 of fp32: anything below would be a miscount
    after = model(ids).numpy()
    assert np.abs(after - before).max() < 0.05 * np.abs(before).max()
    assert not np.array_equal(after, before)


def test_quantize_model_skip_and_no_embeddings():
    model = _Toy()
    report = quantize_model(model, embeddings=False, skip=("head",))
    assert report.linear == ["up", "down"] and report.embedding == []
    assert type(model.head) is paddle.nn.Linear and type(model.embed) is paddle.nn.Embedding
