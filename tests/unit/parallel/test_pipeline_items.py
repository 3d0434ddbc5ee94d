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
