"""Ring attention over soft-capped scores (Gemma 2: cap * tanh(s / cap) before the mask) equals whole-row
capped attention one process runs (models/attention.py eager_attention with the sliding-window bias, and
blocked_attention with its window), output and q/k/v gradients: the ring's blocks of Paddle ops
(parallel/ring_blocks.py) cap each score, so the blocks' partial softmaxes merge exactly, and the backward
goes through the cap's derivative. Rings of 2 and 4 run rank by rank in this process (the stand-in ring of
test_ring_window.py, its ``_ring``); grouped-query heads, packed rows and windows shorter than a chunk, spanning chunks
and as long as the rows. The ring's pair-kernel rule sends soft-capped layers to the blocks even where the
fused CPU kernel is offered."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.models.attention import blocked_attention, build_bias, eager_attention, repeat_kv
from bmtrain_cli.models.attention_choice import ScoreRule, ring_pair_kernel
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


@pytest.mark.parametrize(
    "degree,window,packed",
    [(2, None, False), (2, None, True), (2, 13, True), (4, 3, True), (4, 9, False), (4, 100, True)],
)
def test_soft_capped_ring_equals_whole_rows(degree, window, packed):
    seq = 40 if degree == 2 else 48  # chunks of 10 / 6 tokens
    q, k, v, w, seg = _problem(seq, packed)
    q, k = 3.0 * q, 3.0 * k  # scores well past the cap, so that it bends them
    got = _ring(
        q, k, v, w, seg, window, degree, True, CAP
    )  # the fused kernel offered: the rule picks the blocks
    eager, blocked = _whole(q, k, v, w, seg, window, CAP)
    for want in (eager, blocked):
        for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
    uncapped = _whole(q, k, v, w, seg, window, None)[0]
    assert np.abs(uncapped[0] - eager[0]).max() > 1e-2  # the cap changes the output
    assert np.abs(uncapped[1] - eager[1]).max() > 1e-2  # and the gradients


def test_soft_capped_layers_take_the_blocks():
    for gpu, dtype in ((False, "float32"), (True, "bfloat16")):
        assert ring_pair_kernel(dtype, gpu, False, True)[0] is not None
        kernel, why = ring_pair_kernel(dtype, gpu, False, True, rule=ScoreRule(None, 50.0))
        assert kernel is None and "soft-capped" in why
