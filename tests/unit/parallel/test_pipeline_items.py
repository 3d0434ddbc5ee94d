"""The pipeline items (parallel/pipeline._build_items) run the single-process model's own pieces: run one
after another in one process they give the model's logits, for each family feature that reaches the
layers (rope with grouped-query attention, ALiBi, a sliding window shorter than the rows, tied and untied
heads) and for padded and packed rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.models import build
from bmtrain_cli.parallel.pipeline import _build_items
from tests.unit.models.tiny import TINY

ARCHES = {
    "rope-gqa": TINY,
    "alibi": replace(
        TINY, family="baichuan", fused_qkv=True, num_key_value_heads=4, position_embedding="alibi"
    ),
    "sliding": replace(TINY, family="mistral", sliding_window=3),
    "tied": replace(TINY, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(ARCHES))
def test_items_in_a_row_equal_the_model(name):
    paddle.seed(0)
    model = build(ARCHES[name])
    model.eval()
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(1, model.arch.vocab_size, (2, 8)))
    mask = paddle.to_tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 2, 2, 3]])  # padded; packed
    pos = paddle.to_tensor([[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 0, 1, 2, 3, 0]])
    expected = model(ids, attention_mask=mask, position_ids=pos).numpy()
    x = (ids, mask, pos)
    for item in _build_items(model).layers:
        x = item(x)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_moe_items_carry_the_load_balancing_loss():
    """A mixture of experts with the auxiliary loss on (the first layer dense): the items in a row carry
    the routers' sums to the last item, whose loss (parallel/pipeline_moe.with_aux) and gradients equal
    the single process's ``loss_sum``, the first layer's router included."""
    from bmtrain_cli.ops import reference
    from bmtrain_cli.parallel.pipeline_moe import split_sums, with_aux

    arch = replace(
        TINY,
        family="qwen3_moe",
        num_hidden_layers=3,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=(1,),
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    )
    paddle.seed(0)
    model = build(arch)
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(1, arch.vocab_size, (2, 8)))
    mask = paddle.to_tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8])
    pos = paddle.to_tensor([[0, 1, 2, 3, 4, 5, 0, 0], list(range(8))])
    labels = paddle.where(mask > 0, ids, paddle.full_like(ids, -100))
    want, _ = model.loss_sum(ids, labels, mask, pos)
    want.backward()
    routers = [layer.mlp.gate.weight for layer in model.layers if layer.sparse]
    want_grads = [w.grad.numpy().copy() for w in routers]
    assert model.last_aux_loss is not None and float(model.last_aux_loss) > 0
    model.clear_gradients()
    x = (ids, mask, pos)
    for item in _build_items(model).layers:
        x = item(x)
    logits, sums = split_sums(x)
    assert len(sums) == 1 and sums[0].shape == [3, 4]
    target = paddle.concat([labels[:, 1:], paddle.full([2, 1], -100, "int64")], axis=1)
    ce, count = reference.cross_entropy_sum(logits.reshape([-1, arch.vocab_size]), target.reshape([-1]))
    logged: list = []
    got = with_aux(ce, count, sums, arch, logged)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(float(logged[0]), float(model.last_aux_loss), rtol=1e-6)  # what the log shows
    assert abs(float(got) - float(ce)) > 1e-3  # the auxiliary term is there
    got.backward()
    for w, g in zip(routers, want_grads):
        np.testing.assert_allclose(w.grad.numpy(), g, rtol=1e-4, atol=1e-7)
