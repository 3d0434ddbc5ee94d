"""Ring attention over soft-capped scores (Gemma 2: cap * tanh(s / cap) before the mask) equals whole-row
capped attention one process runs (models/attention.py eager_attention with the sliding-window bias, and
blocked_attention with its window), output and q/k/v gradients: the ring's blocks of Paddle ops
(parallel/ring_blocks.py) cap each score, so the blocks' partial softmaxes merge exactly, and the backward
goes through the cap's derivative; the fused CPU pair kernel (ops/fused_attention.py attention_pair_*) caps
each score before its mask and multiplies dS by 1 - tanh^2, and equals the blocks. Rings of 2 and 4 run rank by
rank in this process (the stand-in ring of test_ring_window.py, its ``_ring``); grouped-query heads, packed
rows, chunks of odd lengths and windows shorter than a chunk, spanning chunks and as long as the rows. The
ring's pair-kernel rule gives soft-capped layers the fused CPU kernel where it is offered, never flash
attention on a GPU."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.models.attention import blocked_attention, build_bias, eager_attention, repeat_kv
from bmtrain_cli.models.attention_choice import ScoreRule, ring_pair_kernel
from bmtrain_cli.parallel import ring_pairs
from tests.unit.ops.test_ring_window import _problem, _ring

CAP = 2.0


def _whole(q, k, v, w, seg, window, cap):
    """One process over the whole rows: the eager reference (additive window bias) and the blocked kernel."""
    s = q.shape[1]
    seg_t = None if seg is None else paddle.to_tensor(seg)
    bias = build_bias(seg_t, seg_t, s, s, 0, "float32", window)
    results = []
    for fn in (
        lambda a, b, c: eager_attention(a, repeat_kv(b, 2), repeat_kv(c, 2), bias, 8**-0.5, cap),
        lambda a, b, c: blocked_attention(a, b, c, seg_t, 8, window=window, softcap=cap),
    ):
        ts = [paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v)]
        out = fn(*ts)
        (out * paddle.to_tensor(w)).sum().backward()
        results.append([out.numpy()] + [t.grad.numpy() for t in ts])
    return results


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    "degree,window,packed",
    [(2, None, False), (2, None, True), (2, 13, True), (4, 3, True), (4, 9, False), (4, 100, True)],
)
def test_soft_capped_ring_equals_whole_rows(ext, fused, degree, window, packed):
    seq = 40 if degree == 2 else 48  # chunks of 10 / 6 tokens
    q, k, v, w, seg = _problem(seq, packed)
    q, k = 3.0 * q, 3.0 * k  # scores well past the cap, so that it bends them
    got = _ring(q, k, v, w, seg, window, degree, fused, CAP)  # fused: the pair kernel, else the blocks
    eager, blocked = _whole(q, k, v, w, seg, window, CAP)
    for want in (eager, blocked):
        for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    uncapped = _whole(q, k, v, w, seg, window, None)[0]
    assert np.abs(uncapped[0] - eager[0]).max() > 1e-2  # the cap changes the output
    assert np.abs(uncapped[1] - eager[1]).max() > 1e-2  # and the gradients


@pytest.mark.parametrize(
    "degree,seq,window,packed",
    # chunks of 9, 7 and 5 tokens (odd: partial query and key tiles), windows inside a chunk and spanning
    # chunks, packed rows
    [(2, 36, None, False), (2, 28, 11, True), (4, 40, 3, False), (4, 40, 7, True), (2, 36, 4, True)],
)
def test_fused_pairs_with_a_cap_equal_the_blocks(ext, monkeypatch, degree, seq, window, packed):
    """The fused CPU pair kernel with a soft cap against the ring's Paddle-op blocks (the reference), output
    and q/k/v gradients, grouped-query heads (4 query heads over 2 KV heads), on scores past the cap."""
    q, k, v, w, seg = _problem(seq, packed)
    q, k = 3.0 * q, 3.0 * k
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, 2, axis=2)) * 8**-0.5
    assert (np.abs(scores) > CAP).any()  # the cap bends some scores (tanh saturates past it)
    calls = []
    forward = ring_pairs.attention_pair_forward
    monkeypatch.setattr(ring_pairs, "attention_pair_forward", lambda p: calls.append(p.softcap) or forward(p))
    fused = _ring(q, k, v, w, seg, window, degree, True, CAP)
    assert calls and set(calls) == {CAP}  # every chunk pair ran the fused kernel, with the cap
    blocks = _ring(q, k, v, w, seg, window, degree, False, CAP)
    for name, a, b in zip(["out", "dq", "dk", "dv"], fused, blocks):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    uncapped = _ring(q, k, v, w, seg, window, degree, True, None)
    assert np.abs(uncapped[0] - fused[0]).max() > 1e-2  # the cap changes the output
    assert np.abs(uncapped[1] - fused[1]).max() > 1e-2  # and the gradients


def test_a_cap_must_not_be_negative(ext):
    x = paddle.zeros([1, 4, 2, 8])
    with pytest.raises(ValueError, match=r"soft cap must be positive \(0: none\), got -1.0"):
        ring_pairs.attention_pair_forward(ring_pairs.Pair(x, x, x, None, True, 0.3, softcap=-1.0))


def test_soft_capped_layers_take_the_fused_pair_kernel_on_a_cpu_and_the_blocks_on_a_gpu():
    capped = ScoreRule(None, 50.0)
    assert ring_pair_kernel("float32", False, False, True, rule=capped)[0] == "cpu_fused"
    assert ring_pair_kernel("float32", False, False, False, rule=capped)[0] is None  # kernels: reference
    assert ring_pair_kernel("bfloat16", True, False, True)[0] == "flash"
    kernel, why = ring_pair_kernel("bfloat16", True, False, True, rule=capped)
    assert kernel is None and "soft-capped" in why
