"""Preference pairs under context parallel in one process: a pair batch's shares (parallel/ring_attention
.split_batch) keep every predicted response token once with its sequence, and a share through a ring of
one gives the whole batch's sequence log-probs, counts and gradients. The multi-process equivalence is
tests/integration/test_context_parallel.py (dpo: cp2)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices, split_batch
from bmtrain_cli.parallel.ulysses import UlyssesCore
from bmtrain_cli.preference.logps import sequence_logps
from bmtrain_cli.preference.objective import PreferenceObjective
from tests.unit.preference.conftest import make_config, tiny_model
from tests.unit.preference.test_objective import VOCAB, _batch, _pairs


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("degree", [2, 4])
def test_the_shares_of_a_pair_batch_hold_every_response_target_once(packed, degree):
    batch = _batch(_pairs(3), packed=packed)
    rows, s = batch["input_ids"].shape
    width = -(-s // (2 * degree)) * 2 * degree
    index, targets = np.full((rows, width), -1), np.full((rows, width), -7)
    for r in range(degree):
        share = split_batch(batch, degree, r)
        idx = local_indices(width, degree, r)
        index[:, idx], targets[:, idx] = share["sequence_index"], share["targets"]
        assert share["context_lead"] == (r == 0)
        assert (share["pair_ids"] == batch["pair_ids"]).all()
    assert (index[:, : s - 1] == batch["sequence_index"]).all() and (index[:, s - 1 :] == -1).all()
    r, c = np.nonzero(index >= 0)
    assert (targets[r, c] == batch["input_ids"][r, c + 1]).all()  # the next token, shifted before the split


@pytest.mark.parametrize("core", [RingCore, UlyssesCore])
@pytest.mark.parametrize("packed", [False, True])
def test_a_share_through_a_ring_of_one_gives_the_whole_batch_log_probs(packed, core):
    """Either mode's core (the ring's blocks; ulysses: the model's own attention over whole rows)."""
    model = tiny_model(VOCAB, seed=2)
    batch = _batch(_pairs(3, seed=1), packed=packed)
    results = []
    for share in (False, True):
        if share:
            model.context_attention = core(Ring(None, [0], 0))
        logps, counts = sequence_logps(model, split_batch(batch, 1, 0) if share else batch, 6)
        (logps * paddle.arange(1, 7, dtype="float32")).sum().backward()
        results.append((logps.numpy(), counts, [p.grad.numpy().copy() for p in model.parameters()]))
        model.clear_gradients()
    (l0, c0, g0), (l1, c1, g1) = results
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    assert list(c1) == list(c0)
    for a, b in zip(g1, g0):  # fp32 round-off of a different summation order, relative to the largest entry
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_only_the_first_rank_of_a_context_group_counts_the_pairs(tmp_path):
    """Every rank of a group computes the pair losses from the summed log-probs; the other ranks' terms
    weigh zero, so the sums over the data ranks count each pair once."""
    model = tiny_model(VOCAB, seed=2)
    model.context_attention = RingCore(Ring(None, [0], 0))
    obj = PreferenceObjective(make_config(tmp_path, dpo_loss="simpo").train, None, lambda t: t)
    batch = _batch(_pairs(3, seed=1), packed=False)
    lead = split_batch(batch, 1, 0)
    other = {**lead, "context_lead": False}
    assert obj.begin_step([lead])[0] == 3 and obj.begin_step([other])[0] == 0
    loss, pairs = obj.loss_sum(model, lead)
    zero, none = obj.loss_sum(model, other)
    assert pairs == 3 and none == 0 and float(loss) > 0 and float(zero) == 0.0
    assert obj.step_metrics()["logps/chosen"] < 0  # the lead's sums, the other's zeros


def test_a_share_without_response_tokens_gives_zeros_through_the_graph():
    """A rank whose chunks hold no response token (a long prompt, a short response in another rank's
    chunks) sums zeros, and its backward still runs (the group's collectives run on every rank) and gives
    every parameter a (zero) gradient, so the gradient reduction over the data ranks sees the same ones."""
    model = tiny_model(VOCAB, seed=2)
    model.context_attention = RingCore(Ring(None, [0], 0))
    share = split_batch(_batch(_pairs(3, seed=1), packed=False), 1, 0)
    share["sequence_index"] = np.full_like(share["sequence_index"], -1)
    logps, counts = sequence_logps(model, share, 6)
    assert logps.numpy().tolist() == [0.0] * 6 and list(counts) == [0.0] * 6
    logps.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.numpy().any() for g in grads)
