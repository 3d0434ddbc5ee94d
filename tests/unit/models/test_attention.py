"""The attention kernels against the eager reference (CPU, fp32): the blocked kernel (causal, packed,
left-padded, grouped-query, forward and backward), the variable-length layout flash_attn_unpadded gets,
the kernel choice (the fused CPU kernel's own parity tests: tests/unit/ops/test_fused_attention.py), and
training batches that go without a mask."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.data.collate import collate
from bmtrain_cli.models import attention as attention_module
from bmtrain_cli.models import build
from bmtrain_cli.models.attention import (
    attend,
    blocked_attention,
    build_bias,
    cu_seqlens,
    eager_attention,
    grouped_attention,
    repeat_kv,
)
from bmtrain_cli.models.attention_choice import (
    DENSE_MAX_SEQ,
    LINEAR_KERNELS,
    choose_kernel,
    training_mask_kind,
)
from bmtrain_cli.models.scoring import right_padded, to_tensors
from tests.unit.models.tiny import TINY

# segment ids: packed with a padded tail; left-padded; one sample; pads only after a packed row
SEGMENTS = {
    "packed": [[1] * 9 + [2] * 14 + [3] * 6 + [0] * 8, [1] * 30 + [2] * 7],
    "left_padded": [[0] * 5 + [1] * 32, [0] * 12 + [1] * 25],
    "right_padded": [[1] * 37, [1] * 20 + [0] * 17],
}


def _qkv(b: int, s: int, heads: int, kv_heads: int, d: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for h in (heads, kv_heads, kv_heads):
        t = paddle.to_tensor(rng.standard_normal((b, s, h, d)).astype("float32"))
        t.stop_gradient = False
        out.append(t)
    return out


def _reference(q, k, v, seg):
    rep = q.shape[2] // k.shape[2]
    bias = build_bias(seg, seg, q.shape[1], k.shape[1], 0, "float32") if seg is not None else None
    return eager_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), bias, float(q.shape[-1]) ** -0.5)


def _value_and_grads(fn, q, k, v, upstream):
    out = fn(q, k, v)
    (out * upstream).sum().backward()
    grads = [t.grad.numpy().copy() for t in (q, k, v)]
    for t in (q, k, v):
        t.clear_gradient()
    return out.numpy(), grads


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("queries", [1, 3, 37], ids=["decode1", "decode3", "full"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared_bias", "per_head_bias"])
def test_grouped_attention_equals_eager_reference(kv_heads, queries, per_head):
    """The grouped_mask kernel: the last ``queries`` queries of left-padded rows over all 37 keys (a
    KV-cache step), with a bias shared by the heads or one per head (ALiBi's shape), values and grads."""
    q, k, v = _qkv(2, 37, 4, kv_heads)
    q = q[:, 37 - queries :].detach()
    q.stop_gradient = False
    seg = paddle.to_tensor(SEGMENTS["left_padded"], dtype="int64")
    bias = build_bias(seg[:, 37 - queries :], seg, queries, 37, 37 - queries, "float32")
    if per_head:
        slopes = paddle.to_tensor([0.5, 0.25, 0.125, 0.0625]).reshape([1, 4, 1, 1])
        bias = bias + slopes * paddle.arange(37, dtype="float32")
    upstream = paddle.to_tensor(np.random.default_rng(9).standard_normal(q.shape).astype("float32"))
    scale = float(q.shape[-1]) ** -0.5
    rep = 4 // kv_heads
    got, got_g = _value_and_grads(lambda a, b, c: grouped_attention(a, b, c, bias, scale), q, k, v, upstream)
    want, want_g = _value_and_grads(
        lambda a, b, c: eager_attention(a, repeat_kv(b, rep), repeat_kv(c, rep), bias, scale),
        q,
        k,
        v,
        upstream,
    )
    np.testing.assert_allclose(got, want, atol=2e-6)
    for name, g, w in zip("qkv", got_g, want_g):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layout", [None, *SEGMENTS], ids=["causal", *SEGMENTS])
@pytest.mark.parametrize("block", [8, 16, 64])
def test_blocked_attention_equals_eager_reference(kv_heads, layout, block):
    q, k, v = _qkv(2, 37, 4, kv_heads)
    seg = None if layout is None else paddle.to_tensor(SEGMENTS[layout], dtype="int64")
    upstream = paddle.to_tensor(np.random.default_rng(9).standard_normal(q.shape).astype("float32"))
    got, got_g = _value_and_grads(lambda a, b, c: blocked_attention(a, b, c, seg, block), q, k, v, upstream)
    want, want_g = _value_and_grads(lambda a, b, c: _reference(a, b, c, seg), q, k, v, upstream)
    np.testing.assert_allclose(got, want, atol=2e-6)
    for name, g, w in zip("qkv", got_g, want_g):
        assert g.shape == w.shape, name  # k/v gradients keep the kv heads: nothing was repeated
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)


def test_blocked_attention_ignores_what_padding_holds():
    """Real queries of a padded row give the same output whatever the padded keys contain."""
    q, k, v = _qkv(2, 37, 4, 2)
    seg = paddle.to_tensor(SEGMENTS["packed"], dtype="int64")
    out = blocked_attention(q, k, v, seg, 16).numpy()
    k2 = k.numpy().copy()
    k2[0, 29:] = 100.0
    out2 = blocked_attention(q, paddle.to_tensor(k2), v, seg, 16).numpy()
    np.testing.assert_allclose(out2[0, :29], out[0, :29], atol=1e-6)


@pytest.mark.parametrize("layout", list(SEGMENTS))
def test_cu_seqlens_lay_rows_end_to_end(layout):
    """The offsets flash_attn_unpadded gets: attending within each run of the flattened rows (done here
    with sdpa per run, as the GPU kernel does in one call) equals the segment-masked reference."""
    seg = paddle.to_tensor(SEGMENTS[layout], dtype="int64")
    b, s = seg.shape
    cu = cu_seqlens(seg)
    assert cu.dtype == paddle.int32
    ids = np.asarray(SEGMENTS[layout]).reshape(-1)
    starts = [i for i in range(b * s) if i % s == 0 or ids[i] != ids[i - 1]]
    assert cu.numpy().tolist() == [*starts, b * s]
    q, k, v = _qkv(b, s, 4, 2)
    flat = [t.reshape([b * s, t.shape[2], t.shape[3]]) for t in (q, k, v)]
    edges = cu.numpy().tolist()
    runs = [
        attend(*(t[i0:i1].unsqueeze(0) for t in flat), None, "sdpa")[0] for i0, i1 in zip(edges, edges[1:])
    ]
    got = paddle.concat(runs).reshape(q.shape).numpy()
    np.testing.assert_allclose(got, _reference(q, k, v, seg).numpy(), atol=2e-6)


@pytest.mark.parametrize("implementation", ["auto", "sdpa", "flash", "eager"])
@pytest.mark.parametrize("layout", [None, "packed"], ids=["causal", "packed"])
def test_attend_implementations_agree_with_fewer_kv_heads(implementation, layout):
    q, k, v = _qkv(2, 37, 4, 2)
    seg = None if layout is None else paddle.to_tensor(SEGMENTS[layout], dtype="int64")
    got = attend(q, k, v, seg, implementation).numpy()
    np.testing.assert_allclose(got, _reference(q, k, v, seg).numpy(), atol=2e-6)


def test_kernel_choice():
    # CPU: the blocked kernel for causal and packed rows, whatever the precision asked for
    assert choose_kernel("causal", "auto", False, False)[0] == "blocked"
    assert choose_kernel("segments", "auto", False, False)[0] == "blocked"
    assert choose_kernel("causal", "flash", True, False)[0] == "blocked"
    # GPU half precision: Paddle's flash kernels; fp32 on a GPU: Paddle's sdpa (one kernel there)
    assert choose_kernel("causal", "auto", True, True)[0] == "flash"
    assert choose_kernel("segments", "auto", True, True)[0] == "flash_varlen"
    assert choose_kernel("segments", "auto", False, True)[0] == "sdpa_mask"
    assert choose_kernel("causal", "auto", False, True)[0] == "sdpa_causal"
    # a bias, an explicit sdpa, the reference, a static graph of unknown length
    assert choose_kernel("bias", "auto", True, True)[0] == "sdpa_mask"
    assert choose_kernel("causal", "sdpa", False, False)[0] == "sdpa_causal"
    assert choose_kernel("segments", "sdpa", False, False)[0] == "sdpa_mask"
    assert choose_kernel("causal", "eager", True, True)[0] == "eager"
    assert choose_kernel("segments", "auto", False, False, static=True)[0] == "sdpa_mask"
    assert choose_kernel("segments", "auto", True, True, static=True)[0] == "sdpa_mask"
    assert choose_kernel("causal", "auto", True, True, static=True)[0] == "flash"
    assert all(
        choose_kernel(k, "auto", h, g)[0] in LINEAR_KERNELS
        for k in ("causal", "segments")
        for h, g in ((False, False), (True, False), (True, True))
    )
    with pytest.raises(ValueError):
        choose_kernel("causal", "fast", False, False)


def test_fused_cpu_kernel_is_chosen_when_the_op_set_carries_it():
    for kind in ("causal", "segments"):
        for seq in (1, DENSE_MAX_SEQ, 8 * DENSE_MAX_SEQ, None):
            assert choose_kernel(kind, "auto", False, False, seq_len=seq, fused_cpu=True)[0] == "cpu_fused"
        assert choose_kernel(kind, "flash", False, False, fused_cpu=True)[0] == "cpu_fused"
        # an explicit sdpa or eager, half precision on a CPU, a GPU, a static graph: not the fused kernel
        assert choose_kernel(kind, "sdpa", False, False, fused_cpu=True)[0].startswith("sdpa")
        assert choose_kernel(kind, "eager", False, False, fused_cpu=True)[0] == "eager"
        assert choose_kernel(kind, "auto", True, False, fused_cpu=True)[0] == "blocked"
        assert choose_kernel(kind, "auto", False, True, fused_cpu=True)[0].startswith("sdpa")
        assert choose_kernel(kind, "auto", False, False, static=True, fused_cpu=True)[0].startswith("sdpa")
    assert choose_kernel("bias", "auto", False, False, fused_cpu=True)[0] == "grouped_mask"
    assert choose_kernel("bias", "sdpa", False, False, fused_cpu=True)[0] == "sdpa_mask"
    assert choose_kernel("bias", "auto", False, False, static=True)[0] == "sdpa_mask"
    assert "cpu_fused" in LINEAR_KERNELS


@pytest.mark.parametrize("layout", [None, "packed"], ids=["causal", "packed"])
def test_attend_runs_the_op_sets_fused_kernel(layout):
    calls = []

    def core(q, k, v, segment_ids=None):
        calls.append(segment_ids)
        return blocked_attention(q, k, v, segment_ids)

    q, k, v = _qkv(2, 37, 4, 2, seed=5)
    seg = None if layout is None else paddle.to_tensor(np.array(SEGMENTS["packed"]), dtype="int64")
    got = attend(q, k, v, seg, "auto", training=True, cpu_kernel=core)
    np.testing.assert_allclose(got.numpy(), _reference(q, k, v, seg).numpy(), atol=2e-6)
    assert len(calls) == 1 and (calls[0] is None) == (layout is None)
    # an additive bias (KV-cache decoding: fewer queries than keys) does not go to it
    attend(q[:, -3:], k, v, None, "auto", cpu_kernel=core)
    assert len(calls) == 1


def test_short_sequences_on_cpu_take_matmul_softmax_long_ones_the_blocked_kernel():
    short, long = DENSE_MAX_SEQ, DENSE_MAX_SEQ + 1
    assert choose_kernel("causal", "auto", False, False, seq_len=short)[0] == "sdpa_causal"
    assert choose_kernel("segments", "auto", False, False, seq_len=short)[0] == "sdpa_mask"
    assert choose_kernel("causal", "auto", False, False, seq_len=long)[0] == "blocked"
    assert choose_kernel("segments", "auto", False, False, seq_len=long)[0] == "blocked"
    # measured on a CPU in fp32 only: half precision on a CPU keeps the blocked kernel
    assert choose_kernel("causal", "auto", True, False, seq_len=short)[0] == "blocked"


@pytest.mark.parametrize("layout", [None, "packed"], ids=["causal", "packed"])
def test_attend_dispatches_by_length_and_both_paths_are_exact(layout, monkeypatch):
    calls = []
    real = attention_module.blocked_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_module, "blocked_attention", counting)
    for s in (37, DENSE_MAX_SEQ + 3):
        q, k, v = _qkv(2, s, 4, 2, seed=s)
        seg = None
        if layout is not None:
            seg = paddle.to_tensor(
                np.repeat(np.arange(1, 4), -(-s // 3))[:s][None].repeat(2, 0), dtype="int64"
            )
        got = attend(q, k, v, seg, "auto", training=True)
        ref = _reference(q, k, v, seg)
        np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=2e-6)
        up = paddle.to_tensor(np.random.default_rng(s).standard_normal(got.shape).astype("float32"))
        g = paddle.grad((got * up).sum(), [q, k, v])
        g_ref = paddle.grad((ref * up).sum(), [q, k, v])
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-5)
    assert calls == [DENSE_MAX_SEQ + 3]  # only the long sequence went through the blocked kernel


def test_memory_planner_plans_the_kernel_training_runs():
    from bmtrain_cli.machine import find_cxx
    from bmtrain_cli.plan.activations import _keeps_scores, attention_kernel
    from bmtrain_cli.plan.devices import get_device
    from bmtrain_cli.plan.workload import Layout, Workload

    cpu = get_device("cpu")
    # kernels: paddle (no fused CPU attention): the length rule between sdpa and the blocked kernel
    for seq, kernel in ((DENSE_MAX_SEQ, "sdpa_causal"), (4 * DENSE_MAX_SEQ, "blocked")):
        w = Workload(arch=TINY, seq_len=seq, global_batch=2, kernels="paddle")
        assert (
            attention_kernel(w, cpu, Layout())
            == kernel
            == choose_kernel("causal", "auto", False, False, seq_len=seq)[0]
        )
        # the short one keeps its [b, heads, s, s] probabilities in the plan; the long one is linear
        assert _keeps_scores(kernel, cpu) == (seq == DENSE_MAX_SEQ)
    # kernels: auto/custom with a compiler: the fused CPU kernel at every length, no score matrix kept
    for kernels in ("auto", "custom"):
        w = Workload(arch=TINY, seq_len=DENSE_MAX_SEQ, global_batch=2, kernels=kernels)
        expected = "cpu_fused" if find_cxx() is not None else "sdpa_causal"
        assert attention_kernel(w, cpu, Layout()) == expected
    assert not _keeps_scores("cpu_fused", cpu)


def test_training_mask_kind():
    assert training_mask_kind(TINY, 512, packed=False) == "causal"
    assert training_mask_kind(TINY, 512, packed=True) == "segments"
    assert training_mask_kind(TINY, 512, packed=False, pipeline=True) == "segments"
    assert training_mask_kind(replace(TINY, position_embedding="alibi"), 512, packed=False) == "bias"
    assert training_mask_kind(replace(TINY, sliding_window=256), 512, packed=False) == "bias"
    assert training_mask_kind(replace(TINY, sliding_window=1024), 512, packed=False) == "causal"


def _batch(rows, pad_id=0):
    rng = np.random.default_rng(3)
    samples = [[(rng.integers(1, 97, n), np.arange(n) >= n // 3) for n in row] for row in rows]
    return collate(samples, pad_id)


def test_right_padded_batches_go_without_a_mask():
    right = _batch([[9], [14]])  # the loader right-pads: one sample per row, padding after it
    assert right_padded(right["attention_mask"]) and "attention_mask" not in to_tensors(right)
    packed = _batch([[5, 7], [12]])
    assert not right_padded(packed["attention_mask"]) and "attention_mask" in to_tensors(packed)
    left = {k: v[:, ::-1].copy() for k, v in right.items()}
    assert not right_padded(left["attention_mask"]) and "attention_mask" in to_tensors(left)
    # pads carry no target: the labels are ignored wherever the mask is 0
    assert (right["labels"][right["attention_mask"] == 0] == -100).all()


@pytest.mark.parametrize("recompute", ["none", "full", "attention"])
@pytest.mark.parametrize("rows", [[[9], [14]], [[5, 7], [3, 4, 2]]], ids=["right_padded", "packed"])
def test_training_loss_and_gradients_equal_the_masked_reference(rows, recompute):
    """A training step as the trainer runs it (to_tensors: no mask for right-padded rows; kernels auto,
    so the fused CPU kernel where the extension builds) gives the loss, count and gradients of the eager
    kernel with the full segment mask."""
    batch = _batch(rows)
    results = []
    for impl, tensors in (
        ("auto", to_tensors(batch)),
        ("eager", {k: paddle.to_tensor(v) for k, v in batch.items()}),
    ):
        paddle.seed(0)
        m = build(replace(TINY, num_key_value_heads=2), attention_implementation=impl)
        m.train()
        if recompute != "none":
            m.enable_recompute(recompute)
        total, count = m.loss_sum(**tensors)
        (total / count).backward()
        grads = {n: p.grad.numpy().copy() for n, p in m.named_parameters()}
        results.append((float(total), float(count), grads))
    (t0, c0, g0), (t1, c1, g1) = results
    assert c0 == c1 > 0
    assert abs(t0 - t1) < 1e-4 * max(1.0, abs(t1))
    for n in g1:
        np.testing.assert_allclose(g0[n], g1[n], atol=2e-6, err_msg=n)
