"""GRPO under context parallel in one process: a completion batch's shares (parallel/ring_attention
.split_batch) hold every completion prediction once, a share through a ring of one gives the whole batch's
log-probs, entropies and gradients, and only a context group's first rank adds to the rollout sums
(grpo/shard.py). The multi-process equivalence is tests/integration/test_grpo_parallel.py (cp2)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.grpo.objective import completion_logps, held_columns
from bmtrain_cli.grpo.rollout import pack
from bmtrain_cli.grpo.shard import DataShard
from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices, split_batch
from tests.unit.preference.conftest import tiny_model

VOCAB = 64


def _batch(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 3, 7)]
    completions = [rng.integers(1, VOCAB, n).tolist() for n in (4, 6, 1)]
    return pack(prompts, completions)


def _cols(batch: dict) -> np.ndarray:
    t = batch["completion_ids"].shape[1]
    cols = batch["completion_start"][:, None] - 1 + np.arange(t)[None, :]
    return np.where(batch["completion_mask"] > 0, cols, batch["completion_start"][:, None] - 1)


@pytest.mark.parametrize("degree", [2, 4])
def test_the_shares_of_a_completion_batch_hold_every_prediction_once(degree):
    batch = _batch()
    cols = _cols(batch)
    width = -(-batch["input_ids"].shape[1] // (2 * degree)) * 2 * degree
    times_held = np.zeros(cols.shape, dtype=np.int64)
    for r in range(degree):
        share = split_batch(batch, degree, r)
        assert (share["context_columns"] == local_indices(width, degree, r)).all()
        assert share["context_lead"] == (r == 0)
        for key in ("completion_ids", "completion_mask", "attention_mask", "completion_start"):
            assert (share[key] == batch[key]).all()  # whole on every rank
        held, local = held_columns(share["context_columns"], cols)
        times_held += held
        rows = np.nonzero(held)[0]
        padded = np.pad(batch["input_ids"], ((0, 0), (0, width - batch["input_ids"].shape[1])))
        assert (share["input_ids"][rows, local[held]] == padded[rows, cols[held]]).all()
        assert (share["position_ids"][rows, local[held]] == cols[held]).all()
    assert (times_held == 1).all()


def test_a_share_through_a_ring_of_one_gives_the_whole_batch_log_probs():
    model = tiny_model(VOCAB, seed=3)
    batch = _batch(seed=1)
    weights = paddle.to_tensor(np.random.default_rng(2).normal(size=batch["completion_ids"].shape), "float32")
    results = []
    for share in (False, True):
        if share:
            model.context_attention = RingCore(Ring(None, [0], 0))
        logps, entropy = completion_logps(model, split_batch(batch, 1, 0) if share else batch, 0.7, True)
        assert entropy is not None
        (logps * weights).sum().backward()
        results.append((logps.numpy(), entropy.numpy(), [p.grad.numpy().copy() for p in model.parameters()]))
        model.clear_gradients()
    (l0, e0, g0), (l1, e1, g1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(e1, e0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):  # fp32 round-off of a different summation order, relative to the largest entry
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_only_the_first_rank_of_a_context_group_adds_to_the_rollout_sums():
    added = []

    def reduce_sum(t):  # what the other ranks of this two-rank context group add: nothing
        added.append(t.numpy().copy())
        return t

    values = np.asarray([[1.5, 2.0]])
    lead, other = (DataShard(0, 1, reduce_sum, context=2, lead=flag) for flag in (True, False))
    assert not lead.alone and DataShard(0, 1, reduce_sum).alone
    np.testing.assert_array_equal(lead.gather(values), values)
    np.testing.assert_array_equal(other.gather(values), np.zeros_like(values))
    assert other.gather_lists([[4, 5, 6]]) == [[]]  # the lead's lists arrive through the sum
    assert len(added) == 4 and not added[1].any()


def test_a_rank_that_holds_no_prediction_still_takes_part_in_the_backward():
    """Its zeros come from the hidden states through the LM head (preference/logps.graph_zero), so the
    group's sum (ContextSum) runs its backward there too and the head gets a (zero) gradient."""
    import types

    from bmtrain_cli.grpo.objective import _summed_over_group

    hidden = paddle.to_tensor(np.random.default_rng(0).normal(size=(2, 4, 8)), "float32", stop_gradient=False)
    head = paddle.nn.Linear(8, 5)
    model = types.SimpleNamespace(context_attention=RingCore(Ring(None, [0], 0)), logits_from_hidden=head)
    logps, entropy = _summed_over_group(model, hidden, np.zeros((2, 3), dtype=bool), None, None, True)
    assert logps.shape == [2, 3] and not logps.numpy().any()
    assert entropy is not None and not entropy.numpy().any()
    logps.sum().backward()
    assert hidden.grad is not None and not hidden.grad.numpy().any()
    assert head.weight.grad is not None and not head.weight.grad.numpy().any()
