"""Soft-capped attention (Gemma 2): the blocked kernel with a sliding window and soft-capped scores
against the eager reference with an additive mask (forward and backward), the kernel choice, and a Gemma 2
model whose training forward builds no s x s mask yet equals the masked reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.models import attention as attention_module
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.attention import blocked_attention, build_bias, eager_attention, repeat_kv
from bmtrain_cli.models.attention_choice import choose_kernel, training_mask_kind
from tests.unit.models.test_attention import _value_and_grads

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "gemma2"
SEGMENTS = {
    "causal": None,
    "packed": [[1] * 9 + [2] * 14 + [3] * 6 + [0] * 8, [1] * 30 + [2] * 7],
    "left_padded": [[0] * 5 + [1] * 32, [0] * 12 + [1] * 25],
}


def _qkv(heads: int, kv_heads: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for h in (heads, kv_heads, kv_heads):
        # scaled so that the scores pass the cap
        t = paddle.to_tensor(3.0 * rng.standard_normal((2, 37, h, 8)).astype("float32"))
        t.stop_gradient = False
        out.append(t)
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("layout", list(SEGMENTS))
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("block", [8, 16])
def test_blocked_soft_capped_windowed_attention_equals_eager_reference(kv_heads, layout, window, block):
    q, k, v = _qkv(4, kv_heads)
    seg = None if SEGMENTS[layout] is None else paddle.to_tensor(SEGMENTS[layout], dtype="int64")
    cap = 2.5
    upstream = paddle.to_tensor(np.random.default_rng(9).standard_normal(q.shape).astype("float32"))

    def reference(a, b, c):
        rep = a.shape[2] // b.shape[2]
        bias = build_bias(seg, seg, 37, 37, 0, "float32", window)
        return eager_attention(a, repeat_kv(b, rep), repeat_kv(c, rep), bias, 8**-0.5, cap)

    got, got_g = _value_and_grads(
        lambda a, b, c: blocked_attention(a, b, c, seg, block, window=window, softcap=cap), q, k, v, upstream
    )
    want, want_g = _value_and_grads(reference, q, k, v, upstream)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
    # the cap bends these scores: without it the output differs
    uncapped = blocked_attention(q, k, v, seg, block, window=window).numpy()
    assert np.abs(uncapped - want).max() > 1e-2


def test_soft_capped_scores_take_the_blocked_or_the_eager_kernel():
    for kind in ("causal", "segments"):
        # not the fused CPU kernel, flash or sdpa: none of them caps scores
        assert choose_kernel(kind, "auto", False, False, fused_cpu=True, softcap=True)[0] == "blocked"
        assert choose_kernel(kind, "auto", True, True, softcap=True)[0] == "blocked"
        assert choose_kernel(kind, "sdpa", False, False, softcap=True)[0] == "blocked"
        assert choose_kernel(kind, "auto", False, False, static=True, softcap=True)[0] == "eager"
    kernel, why = choose_kernel("bias", "auto", False, False, softcap=True)
    assert kernel == "eager" and "soft-capped" in why
    assert choose_kernel("causal", "eager", False, False, softcap=True)[0] == "eager"


def test_a_soft_capped_sliding_window_reaches_the_kernel_without_a_mask():
    arch = load_pretrained(FIXTURE).arch
    assert arch.sliding_window == 8 and arch.attn_logit_softcapping == 3.0
    assert training_mask_kind(arch, 24, packed=False) == "causal"
    assert training_mask_kind(arch, 24, packed=True) == "segments"


def test_gemma2_training_builds_no_square_mask_and_equals_the_masked_reference(monkeypatch):
    """Rows longer than the window: the auto path (blocked kernel, window and cap inside) builds no
    additive bias, and its loss and gradients equal the eager path's (an s x s mask per layer type)."""
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 384, [2, 24]))
    mask = paddle.to_tensor([[1] * 24, [1] * 17 + [0] * 7])

    def loss_and_grads(implementation):
        model = load_pretrained(FIXTURE, kernels="reference", attention_implementation=implementation)
        total, count = model.loss_sum(ids, ids, attention_mask=mask)
        (total / count).backward()
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
        return float(total / count), grads

    want_loss, want = loss_and_grads("eager")
    built = []
    real = attention_module.build_bias
    monkeypatch.setattr(attention_module, "build_bias", lambda *a, **k: built.append(a) or real(*a, **k))
    monkeypatch.setattr("bmtrain_cli.models.decoder.build_bias", attention_module.build_bias)
    got_loss, got = loss_and_grads("auto")
    assert built == []
    assert abs(got_loss - want_loss) <= 1e-6
    assert set(got) == set(want) and len(got) > 10
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=2e-5, err_msg=name)


def test_gemma2_config_of_transformers_4x_reads_the_alternating_rule_and_writes_back():
    """A transformers 4.x config.json (top-level rope_theta, no layer_types): even layers slide, odd ones
    are global; written back, transformers 5's keys come out with the same values."""
    import json

    from bmtrain_cli.models.arch import arch_from_hf_dict, arch_to_hf_dict

    cfg = json.loads((FIXTURE / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "attn_logit_softcapping"):
        cfg.pop(key)
    cfg.update(rope_theta=20000.0, num_hidden_layers=5, cache_implementation="hybrid")
    arch = arch_from_hf_dict(cfg)
    assert [arch.layer_type(i) for i in range(5)] == ["sliding_attention", "full_attention"] * 2 + [
        "sliding_attention"
    ]
    assert arch.rope_theta == 20000.0 and arch.rope_local_theta is None
    assert arch.attn_logit_softcapping == 50.0  # transformers' default where the key is absent
    assert arch.final_logit_softcapping == 5.0 and arch.query_pre_attn_scalar == 24.0
    out = arch_to_hf_dict(arch)
    assert out["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert (out["attn_logit_softcapping"], out["final_logit_softcapping"]) == (50.0, 5.0)
    assert out["cache_implementation"] == "hybrid" and "rope_local_base_freq" not in out
    assert arch_from_hf_dict(out) == arch
