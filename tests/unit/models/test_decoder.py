"""Decoder behaviour that needs no external reference: masks, packed rows, recompute, Baichuan
(W_pack, ALiBi, normalised head), loss accounting, attention implementations."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.errors import UserError
from bmtrain_cli.models import build
from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.attention import build_bias
from bmtrain_cli.models.decoder import CausalLM
from bmtrain_cli.models.hf import hf_state_dict, load_hf_state_dict
from bmtrain_cli.models.rope import alibi_slopes
from tests.unit.models.tiny import TINY

BAICHUAN = replace(TINY, family="baichuan", fused_qkv=True, num_key_value_heads=4)


def _model(arch: ModelArch = TINY, seed: int = 0, **kw) -> CausalLM:
    paddle.seed(seed)
    m = build(arch, **kw)
    m.eval()
    return m


def _ids(shape, seed=1, vocab=97):
    return paddle.to_tensor(np.random.default_rng(seed).integers(0, vocab, shape), dtype="int64")


@pytest.mark.parametrize("arch", [TINY, replace(BAICHUAN, position_embedding="alibi")], ids=["rope", "alibi"])
def test_packed_row_equals_separate_samples(arch):
    m = _model(arch)
    a, b = _ids([1, 5], 2), _ids([1, 7], 3)
    pad = paddle.zeros([1, 4], dtype="int64")
    packed = paddle.concat([a, b, pad], axis=1)
    mask = paddle.to_tensor([[1] * 5 + [2] * 7 + [0] * 4])
    pos = paddle.to_tensor([list(range(5)) + list(range(7)) + [0] * 4])
    out = m(packed, attention_mask=mask, position_ids=pos).numpy()
    np.testing.assert_allclose(out[0, :5], m(a).numpy()[0], atol=2e-5)
    np.testing.assert_allclose(out[0, 5:12], m(b).numpy()[0], atol=2e-5)
    assert np.isfinite(out).all()  # padding rows are not NaN


def test_padding_does_not_change_real_tokens():
    m = _model()
    ids = _ids([2, 9])
    mask = paddle.to_tensor([[1] * 9, [1] * 6 + [0] * 3])
    full = m(ids).numpy()
    masked = m(ids, attention_mask=mask).numpy()
    np.testing.assert_allclose(masked[0], full[0], atol=1e-5)
    np.testing.assert_allclose(masked[1, :6], full[1, :6], atol=1e-5)
    # and the padding tokens' values do not matter
    other = ids.numpy().copy()
    other[1, 6:] = 5
    again = m(paddle.to_tensor(other), attention_mask=mask).numpy()
    np.testing.assert_allclose(again[1, :6], masked[1, :6], atol=1e-6)


@pytest.mark.parametrize("arch", [TINY, replace(BAICHUAN, position_embedding="alibi")], ids=["rope", "alibi"])
def test_attention_implementations_agree(arch):
    ids = _ids([2, 11])
    mask = paddle.to_tensor([[1] * 4 + [2] * 7, [1] * 8 + [0] * 3])
    outs = [
        _model(arch, attention_implementation=impl)(ids, attention_mask=mask).numpy()
        for impl in ("eager", "sdpa", "flash", "auto")
    ]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=2e-5)


def test_loss_sum_counts_and_skips_segment_boundaries():
    m = _model()
    ids = _ids([1, 8])
    labels = ids.numpy().copy()
    labels[0, :2] = -100
    mask = paddle.to_tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
    labels[0, 7] = -100
    total, count = m.loss_sum(ids, paddle.to_tensor(labels), attention_mask=mask)
    # predictions t -> t+1 for t+1 in {2, 3} (segment 1) and {5, 6} (segment 2); 4 starts a new sample
    assert float(count) == 4.0
    logits = m(ids, attention_mask=mask).numpy()[0].astype(np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    want = -sum(logp[t, labels[0, t + 1]] for t in (1, 2, 4, 5))
    assert abs(float(total) - want) < 1e-3
    assert total.dtype == paddle.float32


@pytest.mark.parametrize("tied", [False, True])
def test_loss_sum_matches_logits_path(tied):
    m = _model(replace(TINY, tie_word_embeddings=tied))
    ids = _ids([2, 10])
    total, count = m.loss_sum(ids, ids)
    logits = m(ids)[:, :-1].reshape([-1, 97])
    ce = paddle.nn.functional.cross_entropy(logits, ids[:, 1:].reshape([-1, 1]), reduction="sum")
    assert float(count) == 18.0
    assert abs(float(total) - float(ce)) < 1e-3


@pytest.mark.parametrize("granularity", ["full", "attention"])
def test_recompute_gives_identical_gradients(granularity):
    ids = _ids([2, 12])
    mask = paddle.to_tensor([[1] * 12, [1] * 9 + [0] * 3])
    grads = []
    for recompute in (False, True):
        m = _model()
        m.train()
        if recompute:
            m.enable_recompute(granularity)
        total, count = m.loss_sum(ids, ids, attention_mask=mask)
        (total / count).backward()
        grads.append({n: p.grad.numpy().copy() for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        np.testing.assert_allclose(grads[1][n], grads[0][n], atol=1e-6, err_msg=n)


def test_recompute_num_layers_and_off():
    m = _model()
    m.enable_recompute("full", num_layers=1)
    assert m._recompute_layers == {0}
    m.enable_recompute("attention")
    assert m._recompute_layers == set() and all(layer.self_attn.recompute_core for layer in m.layers)
    m.enable_recompute("none")
    assert not any(layer.self_attn.recompute_core for layer in m.layers)
    with pytest.raises(UserError):
        m.enable_recompute("most")


def test_parameter_names_follow_hugging_face():
    names = set(_model().state_dict())
    assert "model.embed_tokens.weight" in names
    assert "model.layers.1.self_attn.q_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.norm.weight" in names and "lm_head.weight" in names
    assert set(_model(replace(TINY, tie_word_embeddings=True)).state_dict()) == names - {"lm_head.weight"}
    assert "model.layers.0.self_attn.W_pack.weight" in _model(BAICHUAN).state_dict()


def test_parameter_count_matches_arch():
    from bmtrain_cli.models.param_count import count_parameters

    for arch in (
        TINY,
        replace(TINY, attention_bias=True, family="qwen2"),
        replace(TINY, qk_norm=True),
        BAICHUAN,
    ):
        m = _model(arch)
        assert sum(int(np.prod(p.shape)) for p in m.parameters()) == count_parameters(arch)


# ---- Baichuan: derived from the architecture (no offline reference exists) ----
def _as_llama(arch: ModelArch) -> ModelArch:
    return replace(arch, family="llama", fused_qkv=False, norm_head=False)


def test_baichuan_w_pack_split_equals_llama():
    bc = _model(BAICHUAN)
    sd = hf_state_dict(bc)
    assert "model.layers.0.self_attn.W_pack.weight" in sd
    llama = CausalLM(_as_llama(BAICHUAN))
    h = BAICHUAN.hidden_size
    split = {}
    for name, arr in sd.items():
        if name.endswith("W_pack.weight"):
            prefix = name[: -len("W_pack.weight")]
            q, k, v = arr[:h], arr[h : 2 * h], arr[2 * h :]
            split.update(
                {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
            )
        else:
            split[name] = arr
    load_hf_state_dict(llama, split)
    llama.eval()
    ids = _ids([2, 9])
    np.testing.assert_allclose(llama(ids).numpy(), bc(ids).numpy(), atol=1e-5)


def test_baichuan2_norm_head_equals_llama_with_normalised_rows():
    arch = replace(BAICHUAN, norm_head=True)
    bc = _model(arch)
    sd = hf_state_dict(bc)
    w = sd["lm_head.weight"]  # [vocab, hidden]
    sd["lm_head.weight"] = w / np.linalg.norm(w, axis=1, keepdims=True)
    llama = CausalLM(_as_llama(arch))
    load_hf_state_dict(llama, sd)  # splits W_pack itself (model has q/k/v)
    llama.eval()
    ids = _ids([1, 7])
    np.testing.assert_allclose(llama(ids).numpy(), bc(ids).numpy(), atol=1e-5)
    total, count = bc.loss_sum(ids, ids)
    total2, _ = llama.loss_sum(ids, ids)
    assert abs(float(total) - float(total2)) < 1e-4


def test_alibi_slopes_formula():
    # powers of two: 2^(-8 i / n), i = 1..n
    for n in (4, 8, 32):
        np.testing.assert_allclose(alibi_slopes(n), [2 ** (-8 * i / n) for i in range(1, n + 1)], rtol=1e-12)
    # 40 heads (Baichuan 13B): 32 heads at 2^(-i/4), then the odd ones of the 64-head series
    want = [2 ** (-i / 4) for i in range(1, 33)] + [2 ** (-(2 * j + 1) / 8) for j in range(8)]
    np.testing.assert_allclose(alibi_slopes(40), want, rtol=1e-12)


def test_alibi_bias_equals_baichuan_absolute_form_under_softmax():
    slopes = paddle.to_tensor(alibi_slopes(4), dtype="float32")
    bias = build_bias(None, None, 6, 6, 0, "float32", alibi=slopes).numpy()[0]  # [h, q, k]
    scores = np.random.default_rng(0).normal(size=(4, 6, 6)).astype(np.float32)
    causal = np.tril(np.ones((6, 6), dtype=bool))
    absolute = np.array(alibi_slopes(4))[:, None, None] * np.arange(6)[None, None, :]  # Baichuan 13B form
    ref = np.where(causal, scores + absolute, -np.inf)
    ours = scores + bias

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    np.testing.assert_allclose(softmax(ours), softmax(ref), atol=1e-6)


def test_sliding_window_bias():
    bias = build_bias(None, None, 6, 6, 0, "float32", sliding_window=3).numpy()[0, 0]
    allowed = bias == 0
    want = np.array([[0 <= i - j < 3 for j in range(6)] for i in range(6)])
    np.testing.assert_array_equal(allowed, want)


def test_bad_architectures_are_user_errors():
    with pytest.raises(UserError, match="multiple"):
        CausalLM(replace(TINY, num_key_value_heads=3))
    with pytest.raises(UserError, match="rope_scaling"):
        CausalLM(replace(TINY, rope_scaling={"rope_type": "longrope2", "factor": 2.0}))
    with pytest.raises(UserError):
        CausalLM(TINY, attention_implementation="magic")


def test_rope_default_matches_closed_form():
    from bmtrain_cli.models.rope import RotaryTables

    cos, sin = RotaryTables(8, 10000.0, None, 64)(paddle.to_tensor([[0, 1, 5]]))
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ang = np.array([0, 1, 5])[:, None] * inv[None]
    np.testing.assert_allclose(cos.numpy()[0], np.cos(np.concatenate([ang, ang], -1)), atol=1e-6)
    np.testing.assert_allclose(sin.numpy()[0, 2, :4], np.sin(5 * inv), atol=1e-6)
    assert math.isclose(float(cos.numpy()[0, 0, 0]), 1.0)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 50},
        {
            "rope_type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0],
            "original_max_position_embeddings": 50,
        },
    ],
    ids=["dynamic", "longrope"],
)
def test_a_share_of_the_positions_takes_the_whole_rows_tables_given_their_longest(scaling):
    """Context parallel: a share's positions (here the middle of a 64-token row, largest 47 of 63) give the
    whole row's tables when the row's largest position comes with them, and other tables without it
    (the original length, 50, lies between)."""
    from bmtrain_cli.models.rope import RotaryTables

    tables = RotaryTables(8, 10000.0, scaling, 128)
    assert tables.reads_longest
    row = paddle.arange(64).reshape([1, 64])
    share = row[:, 16:48]
    whole = [t.numpy()[:, 16:48] for t in tables(row)]
    given = [t.numpy() for t in tables(share, paddle.to_tensor(63))]
    alone = [t.numpy() for t in tables(share)]
    for w, g, a in zip(whole, given, alone):
        np.testing.assert_array_equal(g, w)
        assert np.abs(a - w).max() > 1e-3  # 48 tokens are within the original 50, the row's 64 beyond
    assert not RotaryTables(8, 10000.0, None, 128).reads_longest


@pytest.mark.parametrize("full_graph", [True, False], ids=["ast", "sot"])
def test_to_static_loss_and_grads_match_dygraph(full_graph):
    ids = _ids([2, 10])
    mask = paddle.to_tensor([[1] * 10, [1] * 4 + [2] * 4 + [0] * 2])

    class MeanLoss(paddle.nn.Layer):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, ids, labels, mask):
            total, count = self.lm.loss_sum(ids, labels, attention_mask=mask)
            return total / count

    results = []
    for static in (False, True):
        m = _model(kernels="reference")
        m.train()
        fn = MeanLoss(m)
        if static:
            fn = paddle.jit.to_static(fn, full_graph=full_graph)
        loss = fn(ids, ids, mask)
        loss.backward()
        results.append((float(loss), m.model.layers[0].self_attn.q_proj.weight.grad.numpy().copy()))
    assert abs(results[0][0] - results[1][0]) < 1e-5
    np.testing.assert_allclose(results[1][1], results[0][1], atol=1e-6)
