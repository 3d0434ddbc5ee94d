"""Gradient compression codecs and error feedback (single process; the all-gather is simulated)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import ParallelConfig
from bmtrain_cli.parallel.compression import (
    Int8Compressor,
    ThresholdCompressor,
    TopKCompressor,
    make_compressor,
)


def test_int8_roundtrip_error_is_bounded_per_chunk():
    rng = np.random.default_rng(0)
    x = rng.normal(size=1000).astype(np.float32)
    x[:256] *= 100.0  # one chunk with a large scale must not hurt the others
    c = Int8Compressor(chunk=256)
    payload = c.encode(paddle.to_tensor(x))
    y = c.decode(payload, 1000).numpy()
    for start in range(0, 1000, 256):
        chunk = x[start : start + 256]
        assert np.abs(y[start : start + 256] - chunk).max() <= np.abs(chunk).max() / 127 * 0.5 + 1e-6
    assert c.payload_bytes(payload) == 1024 + 4 * 4  # int8 values (padded) + one fp32 scale per chunk


def test_topk_error_feedback_sends_everything_eventually():
    rng = np.random.default_rng(1)
    c = TopKCompressor(ratio=0.1)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(30)]
    sent = np.zeros(50, np.float32)
    for g in grads:
        payload = c.encode(paddle.to_tensor(g))
        assert payload[0].shape[0] == 5
        sent += c.decode(payload, 50).numpy()
    # what was sent plus what is still held back equals everything that came in
    np.testing.assert_allclose(sent + c.residual.numpy(), np.sum(grads, axis=0), rtol=1e-5, atol=1e-5)


def test_threshold_sends_large_entries_and_keeps_the_rest_in_the_residual():
    c = ThresholdCompressor(threshold=0.5)
    idx, values = c.encode(paddle.to_tensor(np.array([0.1, -0.7, 0.3, 0.6, 0.0], np.float32)))
    assert idx.numpy().tolist() == [1, 3] and values.numpy().tolist() == pytest.approx([-0.7, 0.6])
    np.testing.assert_allclose(c.residual.numpy(), [0.1, 0, 0.3, 0, 0], atol=1e-7)
    # the held-back 0.3 + 0.3 reaches the threshold next step; 0.1 + 0.1 does not
    idx, values = c.encode(paddle.to_tensor(np.array([0.1, 0, 0.3, 0, 0], np.float32)))
    assert idx.numpy().tolist() == [2] and values.numpy().tolist() == pytest.approx([0.6])
    empty = c.encode(paddle.zeros([5]))
    assert empty[0].shape[0] == 0 and float(c.decode(empty, 5).abs().sum()) == 0.0


def test_threshold_error_feedback_sends_everything_eventually():
    rng = np.random.default_rng(3)
    c = ThresholdCompressor(threshold=1.0)
    grads = [rng.normal(size=50).astype(np.float32) for _ in range(30)]
    sent = np.zeros(50, np.float32)
    counts = []
    for g in grads:
        payload = c.encode(paddle.to_tensor(g))
        counts.append(int(payload[0].shape[0]))
        sent += c.decode(payload, 50).numpy()
    np.testing.assert_allclose(sent + c.residual.numpy(), np.sum(grads, axis=0), rtol=1e-5, atol=1e-5)
    assert 0 < sum(counts) < 0.5 * 50 * 30  # sparse, yet something is sent
    assert np.abs(c.residual.numpy()).max() < 1.0


@pytest.mark.parametrize("kind", ["int8", "topk", "threshold"])
def test_two_rank_training_with_compression_matches_uncompressed(kind):
    """Linear regression on two simulated data ranks: final loss within 1% of exact gradient sums."""
    rng = np.random.default_rng(2)
    w_true = rng.normal(size=20).astype(np.float32)
    xs = [rng.normal(size=(64, 20)).astype(np.float32) for _ in range(2)]
    ys = [x @ w_true for x in xs]

    def loss(w):
        return float(sum(np.mean((x @ w - y) ** 2) for x, y in zip(xs, ys)))

    def grad(w, r):
        x, y = xs[r], ys[r]
        return (2 * x.T @ (x @ w - y) / len(y)).astype(np.float32)

    par = ParallelConfig(
        data_parallel=2, gradient_compression=kind, topk_ratio=0.25, compression_threshold=0.05
    )
    comps = [make_compressor(par) for _ in range(2)]
    w_ref = np.zeros(20, np.float32)
    w = np.zeros(20, np.float32)
    for _ in range(150):
        w_ref -= 0.02 * (grad(w_ref, 0) + grad(w_ref, 1))
        total = sum(c.decode(c.encode(paddle.to_tensor(grad(w, r))), 20).numpy() for r, c in enumerate(comps))
        w -= 0.02 * total
    assert loss(w) <= loss(w_ref) * 1.01 + 1e-4
    assert loss(w) < loss(np.zeros(20, np.float32)) * 0.01


def test_no_compressor_when_off():
    assert make_compressor(ParallelConfig()) is None
