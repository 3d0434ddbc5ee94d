"""Our custom ops inside paddle.jit.to_static programs: forward and backward equal dygraph.

Both translators are covered: SOT (the default, what train_config.to_static uses) and the AST translator
(full_graph=True) with dynamic batch and sequence dimensions (InputSpec [None, None]), where shapes read
-1 and the wrappers' checks must still pass.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from paddle.static import InputSpec

from bmtrain_cli.models import build
from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.decoder import LossSum
from bmtrain_cli.ops import custom

ARCH = ModelArch(
    family="qwen3",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=61,
    max_position_embeddings=32,
    qk_norm=True,
    tie_word_embeddings=True,  # the LM-head loss with transpose_weight
)


def _batch(batch: int, seq: int):
    rng = np.random.default_rng(batch * 100 + seq)
    ids = rng.integers(0, ARCH.vocab_size, (batch, seq))
    labels = ids.copy()
    labels[:, :3] = -100
    mask = np.ones_like(ids)
    mask[-1, seq - 2 :] = 0
    labels[-1, seq - 2 :] = -100
    pos = np.tile(np.arange(seq), (batch, 1))
    return [paddle.to_tensor(a, dtype="int64") for a in (ids, labels, mask, pos)]


def _loss_and_grads(fn, model, batch):
    s, c = fn(*batch)
    (s / c).backward()
    grads = {p.name: p.grad.numpy().copy() for p in model.parameters() if p.grad is not None}
    model.clear_gradients()
    return float(s / c), grads


@pytest.mark.parametrize("full_graph", [False, True], ids=["sot", "ast-dynamic-shapes"])
def test_custom_ops_under_to_static_match_dygraph(ext, full_graph):
    paddle.seed(7)
    model = build(ARCH, kernels="custom")
    assert set(model.ops.sources.values()) == {"custom"}
    wrapped = LossSum(model)
    spec = [InputSpec([None, None], "int64")] * 4 if full_graph else None
    static = paddle.jit.to_static(wrapped, full_graph=full_graph, input_spec=spec)
    for shape in ((2, 12), (3, 9)):  # a second shape: SOT retraces, AST reuses the dynamic program
        batch = _batch(*shape)
        le, ge = _loss_and_grads(wrapped.forward, model, batch)
        ls, gs = _loss_and_grads(static, model, batch)
        assert abs(le - ls) < 1e-5 * max(1.0, abs(le))
        assert ge.keys() == gs.keys() and len(ge) == len(model.parameters())
        for name, g in ge.items():
            np.testing.assert_allclose(
                gs[name], g, atol=1e-5 * max(1.0, float(np.abs(g).max())), err_msg=name
            )
    if full_graph:
        ops = {op.name() for op in static.forward.concrete_program.main_program.global_block().ops}
        assert {"custom_op.bmt_rms_norm", "custom_op.bmt_rotary", "custom_op.bmt_swiglu"} <= ops


def test_linear_cross_entropy_traced_path_matches_chunk_loop(ext):
    """Under to_static the LM-head loss is logits + the fused softmax-xent PyLayer (no in-place chunk
    loop); its loss and gradients equal the eager chunked version's."""
    rng = np.random.default_rng(3)
    h0 = rng.standard_normal((10, 16)).astype("float32")
    w0 = rng.standard_normal((16, 23)).astype("float32")
    lab = paddle.to_tensor(np.where(rng.random(10) < 0.3, -100, rng.integers(0, 23, 10)), dtype="int64")

    def run(fn):
        h = paddle.to_tensor(h0, stop_gradient=False)
        w = paddle.to_tensor(w0, stop_gradient=False)
        s, c = fn(h, w, lab)
        (s / c).backward()
        return float(s), float(c), h.grad.numpy(), w.grad.numpy()

    eager = run(lambda h, w, y: custom.linear_cross_entropy(h, w, y, chunk_tokens=3))
    static = run(paddle.jit.to_static(lambda h, w, y: custom.linear_cross_entropy(h, w, y, chunk_tokens=3)))
    assert eager[1] == static[1] == float((lab != -100).astype("float32").sum())
    assert abs(eager[0] - static[0]) < 1e-5 * max(1.0, abs(eager[0]))
    np.testing.assert_allclose(static[2], eager[2], atol=1e-6)
    np.testing.assert_allclose(static[3], eager[3], atol=1e-6)
