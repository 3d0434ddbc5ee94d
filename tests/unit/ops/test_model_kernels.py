"""The same tiny model trained a few steps with kernels custom and reference: same losses and gradients
(custom includes the fused CPU attention core, reference Paddle's sdpa).

Tolerances: losses rtol 1e-5 per step; gradients max abs error <= 1e-5 * max(1, max |reference grad|).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import paddle
import pytest

from bmtrain_cli.models import build
from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.ops import fused_attention

ARCH = ModelArch(
    family="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=97,
    max_position_embeddings=64,
)


def _batch():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ARCH.vocab_size, (2, 16))
    labels = ids.copy()
    labels[:, :5] = -100  # prompt tokens
    mask = np.ones_like(ids)
    mask[1, 12:] = 0  # padding on the second row
    labels[1, 12:] = -100
    mask[0, 8:] = 2  # two packed samples in the first row
    pos = np.tile(np.arange(16), (2, 1))
    pos[0, 8:] = np.arange(8)
    return [paddle.to_tensor(a, dtype="int64") for a in (ids, labels, mask, pos)]


def _train(arch: ModelArch, kernels: str, steps: int = 3, recompute: str = "none"):
    paddle.seed(1234)
    model = build(arch, kernels=kernels)
    model.train()
    model.enable_recompute(recompute)  # custom backward ops re-run under recompute (rotary's attributes)
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters())
    ids, labels, mask, pos = _batch()
    losses, first_grads = [], None
    for i in range(steps):
        s, c = model.loss_sum(ids, labels, attention_mask=mask, position_ids=pos)
        (s / c).backward()
        if i == 0:
            first_grads = {p.name: p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}
            names = [p.name for p in model.parameters()]
        losses.append(float(s / c))
        opt.step()
        opt.clear_grad()
    return model, losses, first_grads, names


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"family": "qwen3", "qk_norm": True, "tie_word_embeddings": True},
        {"recompute": "full"},
        {"recompute": "attention"},
    ],
    ids=["llama-gqa", "qwen3-qknorm-tied", "recompute-full", "recompute-attention"],
)
def test_custom_matches_reference_training(ext, variant, monkeypatch):
    variant = dict(variant)
    recompute = variant.pop("recompute", "none")
    arch = dataclasses.replace(ARCH, **variant)
    fused_calls = []
    apply = fused_attention._FusedAttention.apply
    monkeypatch.setattr(
        fused_attention._FusedAttention, "apply", lambda *a: fused_calls.append(1) or apply(*a)
    )
    m_ref, l_ref, g_ref, names_ref = _train(arch, "reference", recompute=recompute)
    assert not fused_calls and m_ref.ops.attention is None  # reference: Paddle's sdpa
    m_cus, l_cus, g_cus, names_cus = _train(arch, "custom", recompute=recompute)
    assert set(m_cus.ops.sources.values()) == {"custom"} and m_ref.ops.name == "reference"
    assert fused_calls  # custom on a CPU: the fused attention core (packed rows, padding: segment ids)
    np.testing.assert_allclose(l_cus, l_ref, rtol=1e-5)
    assert l_ref[-1] < l_ref[0]  # it trains
    assert len(g_ref) == len(g_cus) == len(names_ref)
    for n_ref, n_cus in zip(names_ref, names_cus):
        a, b = g_cus[n_cus], g_ref[n_ref]
        scale = max(1.0, float(np.abs(b).max()))
        assert float(np.abs(a - b).max()) <= 1e-5 * scale, n_ref
