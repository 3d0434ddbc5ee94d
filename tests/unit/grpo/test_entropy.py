"""The per-token entropy of grpo/objective.py (the max/sum-exp form that tensor parallel reduces over the
vocabulary shards) against -sum p log p computed in float64 with numpy."""

from __future__ import annotations

import numpy as np
import paddle

from bmtrain_cli.grpo.objective import token_entropy
from bmtrain_cli.models.layers import PlainFactory


def _reference(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


def test_entropy_equals_minus_sum_p_log_p():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((6, 50)) * 4).astype(np.float32)
    logits[0] = 0.0  # uniform: log(50)
    logits[1, 3] = 80.0  # almost one-hot: near zero, and no overflow
    got = token_entropy(paddle.to_tensor(logits), PlainFactory()).numpy()
    want = _reference(logits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert abs(got[0] - np.log(50)) < 1e-5 and got[1] < 1e-6
