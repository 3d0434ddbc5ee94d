"""Context parallel in one process: the balanced layout, the split of a batch (targets shifted over the
whole row before the split, positions and segment ids kept) and the model's context path. A ring of one
rank runs every chunk pair the ring runs on several (front/back, causal/full, skipped); the multi-process
equivalence is tests/integration/test_ring_attention.py and test_context_parallel.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.attention import blocked_attention
from bmtrain_cli.models.decoder import CausalLM, LossSum
from bmtrain_cli.models.families import family
from bmtrain_cli.models.scoring import count_targets, to_tensors
from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices, split_batch
from bmtrain_cli.parallel.ulysses import UlyssesCore
from tests.tiny import ARCH

# Gemma 3's interleaved sliding (window 5 of 22-token rows) and global layers: the sliding layers' window
# reaches the context group's core (the ring's pairs and blocks; ulysses: the rows' bias)
GEMMA3 = replace(
    replace(ARCH, family="gemma3_text", **family("gemma3_text").defaults),
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=5,
    query_pre_attn_scalar=16.0,
)
# Gemma 2's soft-capped scores (a cap the tiny model's scores reach) with its interleaved sliding layers:
# the ring's blocks cap each score (the fused kernel offered or not); ulysses gives its attention the cap
GEMMA2 = replace(
    replace(ARCH, family="gemma2", **family("gemma2").defaults),
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=5,
    query_pre_attn_scalar=16.0,
    attn_logit_softcapping=0.02,
)


def _batch(packed: bool, s: int = 22):
    rng = np.random.default_rng(1)
    ids = rng.integers(1, ARCH.vocab_size, (2, s))
    labels = ids.copy()
    labels[:, :3] = IGNORE_INDEX
    mask = np.ones_like(ids)
    mask[1, s - 5 :] = 0
    pos = np.tile(np.arange(s), (2, 1))
    if packed:
        mask[0, 9:] = 2
        pos[0, 9:] = np.arange(s - 9)
    labels[mask == 0] = IGNORE_INDEX
    pos[mask == 0] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_the_balanced_layout_holds_every_token_once(degree):
    held = np.concatenate([local_indices(32, degree, r) for r in range(degree)])
    assert sorted(held.tolist()) == list(range(32))
    c = 32 // (2 * degree)
    assert local_indices(32, degree, 0).tolist() == list(range(c)) + list(range(32 - c, 32))


@pytest.mark.parametrize("packed", [False, True])
def test_the_shares_put_back_give_the_shifted_rows(packed):
    batch = _batch(packed)
    shares = [split_batch(batch, 2, r) for r in range(2)]
    width = 24  # 22 padded to a multiple of 2 x 2
    targets = np.full((2, width), -1)
    for r, share in enumerate(shares):
        idx = local_indices(width, 2, r)
        targets[:, idx] = share["targets"]
        assert (share["position_ids"] == np.pad(batch["position_ids"], ((0, 0), (0, 2)))[:, idx]).all()
        assert ("segment_ids" in share) == packed  # right-padded rows attend causally
    want = np.full((2, width), IGNORE_INDEX)
    want[:, :21] = batch["labels"][:, 1:]
    if packed:
        want[0, 8] = IGNORE_INDEX  # the last token of the first sample predicts nothing
    assert (targets == want).all()
    assert sum(count_targets(s) for s in shares) == count_targets(batch)


@pytest.mark.parametrize("packed", [False, True])
def test_a_ring_of_one_equals_blocked_attention(packed):
    paddle.seed(0)
    q = paddle.randn([2, 24, 4, 8])
    k, v = paddle.randn([2, 24, 2, 8]), paddle.randn([2, 24, 2, 8])
    seg = paddle.to_tensor(split_batch(_batch(True, s=24), 1, 0)["segment_ids"]) if packed else None
    grads = []
    for fn in (
        lambda *a: RingCore(Ring(None, [0], 0), block=5)(*a),
        lambda *a: blocked_attention(*a, block=8),
    ):
        ts = [paddle.to_tensor(t.numpy(), stop_gradient=False) for t in (q, k, v)]
        out = fn(*ts, seg)
        (out * out.sin()).sum().backward()
        grads.append([out.numpy()] + [t.grad.numpy() for t in ts])
    for got, want in zip(*grads):  # fp32 round-off of two different summation orders (blocks of 5 vs 8)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=3e-6)


@pytest.mark.parametrize("layer", [False, True])
@pytest.mark.parametrize("arch", [ARCH, GEMMA3, GEMMA2], ids=["llama", "gemma3", "gemma2"])
@pytest.mark.parametrize("core", [RingCore, UlyssesCore])
@pytest.mark.parametrize("packed", [False, True])
def test_the_model_context_path_equals_its_loss(packed, core, arch, layer):
    """CausalLM.loss_sum on a share (targets, positions, the rows' segment ids) with a context group of
    one (the ring's blocks; ulysses: the model's own attention kernel over whole rows): the same loss and
    gradients as on the unsplit batch; also through ``LossSum`` (``layer``), the forward that sharding
    stage 2/3's group-sharded wrapper runs."""
    paddle.seed(3)
    model = CausalLM(arch, kernels="reference")
    model.init_weights()
    loss_fn = LossSum(model) if layer else model.loss_sum
    batch = _batch(packed)
    results = []
    for share in (False, True):
        if share:
            model.context_attention = core(Ring(None, [0], 0))
        total, count = loss_fn(**to_tensors(split_batch(batch, 1, 0) if share else batch))
        total.backward()
        results.append((float(total), float(count), [p.grad.numpy().copy() for p in model.parameters()]))
        model.clear_gradients()
    (t0, c0, g0), (t1, c1, g1) = results
    assert c0 == c1 == count_targets(batch)
    np.testing.assert_allclose(t1, t0, rtol=1e-6)
    for a, b in zip(g1, g0):  # fp32 round-off, on the scale of the gradients (Gemma 3's are larger)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(b).max())))


@pytest.mark.parametrize("arch", [ARCH, GEMMA3, GEMMA2], ids=["llama", "gemma3", "gemma2"])
@pytest.mark.parametrize("packed", [False, True])
def test_the_model_context_path_with_the_fused_kernel_per_chunk_pair(packed, arch):
    """attach_context gives the ring the fused CPU kernel when the model's op set carries it (kernels
    custom) and Paddle-op blocks otherwise (kernels reference); with the kernel, the loss and gradients on
    a share equal those on the unsplit batch."""
    import types

    from bmtrain_cli.ops.build import load_extension
    from bmtrain_cli.parallel.wrapping import ModelWrapper

    load_extension()
    wrapper = ModelWrapper(types.SimpleNamespace(context_ring=Ring(None, [0], 0), config=None))
    assert wrapper.attach_context(CausalLM(ARCH, kernels="reference")).context_attention.fused is False
    paddle.seed(3)
    model = wrapper.attach_context(CausalLM(arch, kernels="custom"))
    assert model.context_attention.fused is True
    model.init_weights()
    batch = _batch(packed)
    results = []
    for share in (False, True):
        b = split_batch(batch, 1, 0) if share else batch
        total, _ = model.loss_sum(**to_tensors(b))
        total.backward()
        results.append((float(total), [p.grad.numpy().copy() for p in model.parameters()]))
        model.clear_gradients()
    (t0, g0), (t1, g1) = results
    np.testing.assert_allclose(t1, t0, rtol=1e-6)
    for a, b in zip(g1, g0):  # fp32 round-off, on the scale of the gradients (Gemma 3's are larger)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(b).max())))


def test_the_tiny_gemma2_cap_bends_its_scores():
    """The cap GEMMA2 sets changes the gradients well beyond the tolerance of the context path's cases
    above (so they check capped scores)."""
    batch = to_tensors(_batch(False))
    grads = []
    for cap in (GEMMA2.attn_logit_softcapping, None):
        paddle.seed(3)
        model = CausalLM(replace(GEMMA2, attn_logit_softcapping=cap), kernels="reference")
        model.init_weights()
        model.loss_sum(**batch)[0].backward()
        grads.append([p.grad.numpy().copy() for p in model.parameters()])
    rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(*grads) if np.abs(b).max() > 0)
    assert rel > 1e-2, rel
