"""A mixture of experts' load-balancing loss under context parallel, in one process: each rank routes only
its share of a micro-batch's tokens, and the routers' per-expert sums are summed over the context group
before the loss (models/moe.py load_balancing_loss ``group_sum``; parallel/ring_attention.py Ring.sum).
Two shares of a fake 2-rank group give the whole micro-batch's value on each rank and, with each rank's
term weighted by its predicted tokens, the whole loss's router gradient summed over the ranks; the model's
context path with a group of one equals its loss on the unsplit batch. The multi-process run against one
process is tests/integration/test_context_parallel.py."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.hf import build
from bmtrain_cli.models.moe import adds_aux_loss, load_balancing_loss
from bmtrain_cli.models.scoring import count_targets, to_tensors
from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices, split_batch
from bmtrain_cli.parallel.ulysses import UlyssesCore
from bmtrain_cli.preference.objective import PreferenceObjective
from tests.unit.models.test_moe import fresh_qwen3_moe
from tests.unit.preference.conftest import make_config
from tests.unit.preference.test_objective import _batch, _pairs

EXPERTS, TOP_K = 4, 2


def _mask(b: int, s: int, packed: bool = True) -> np.ndarray:
    mask = np.ones((b, s), dtype=np.int64)
    mask[1, s - 5 :] = 0  # right padding: not counted
    if packed:
        mask[0, 7:] = 2  # a second packed sample
    return mask


def _moe_model():
    """A fresh tiny Qwen3-MoE (vocabulary 64, EXPERTS experts, top TOP_K) with a heavy load-balancing loss."""
    paddle.seed(0)
    return build(fresh_qwen3_moe(router_aux_loss_coef=0.5))


def test_two_shares_summed_over_the_group_give_the_whole_loss_and_router_gradient():
    b, s, layers = 2, 16, 3
    rng = np.random.default_rng(0)
    whole = paddle.to_tensor(rng.normal(size=(layers, b, s, EXPERTS)).astype(np.float32), stop_gradient=False)
    mask = _mask(b, s)
    want = load_balancing_loss(
        [whole[i].reshape([-1, EXPERTS]) for i in range(layers)], EXPERTS, TOP_K, paddle.to_tensor(mask)
    )
    counted = [int((mask[:, local_indices(s, 2, r)] != 0).sum()) for r in range(2)]  # each rank's weight
    (want * float(sum(counted))).backward()
    want_grad = whole.grad.numpy().copy()
    whole.clear_gradient()

    def share(r: int, group_sum):
        idx = paddle.to_tensor(local_indices(s, 2, r))
        logits = [paddle.gather(whole[i], idx, axis=1).reshape([-1, EXPERTS]) for i in range(layers)]
        m = paddle.to_tensor(mask[:, local_indices(s, 2, r)])
        return load_balancing_loss(logits, EXPERTS, TOP_K, m, group_sum)

    # each rank's own sums (with their graph), then each rank's loss over its sums plus the other's: the
    # group sum whose gradient, added over the ranks, is the group's summed gradient (ContextSum)
    own = []
    for r in range(2):
        share(r, lambda x: own.append(x) or x)
    auxes = [share(r, lambda x, r=r: x + own[1 - r]) for r in range(2)]
    for aux in auxes:
        np.testing.assert_allclose(float(aux), float(want), rtol=1e-6)
    assert abs(float(share(0, None)) - float(want)) > 1e-3  # one share alone is not the whole's
    (auxes[0] * float(counted[0]) + auxes[1] * float(counted[1])).backward()
    np.testing.assert_allclose(whole.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)
    assert np.abs(want_grad).max() > 0


def test_a_ring_of_one_sums_with_the_gradient_passing_through():
    x = paddle.to_tensor([1.0, 2.0], stop_gradient=False)
    y = Ring(None, [0], 0).sum(x)
    (y * paddle.to_tensor([3.0, 4.0])).sum().backward()
    assert y.numpy().tolist() == [1.0, 2.0] and x.grad.numpy().tolist() == [3.0, 4.0]


@pytest.mark.parametrize("core", [RingCore, UlyssesCore])
@pytest.mark.parametrize("packed", [False, True])
def test_the_moe_context_path_equals_its_loss_with_the_load_balancing_loss(packed, core):
    """CausalLM.loss_sum on a share (padded to an even width: the padding routed but not counted) with a
    context group of one (either mode's core): the same loss (cross entropy + coef x aux x tokens), aux and gradients as on the
    unsplit batch, packed or right-padded rows (whose attention mask the load-balancing loss keeps, as
    transformers leaves padding out: to_tensors' keep_mask, which the SFT objective sets for such models)."""
    model = _moe_model()
    b, s = 2, 21
    ids = np.random.default_rng(1).integers(1, 64, (b, s))
    mask = _mask(b, s, packed)
    labels = np.where(mask == 0, IGNORE_INDEX, ids)
    pos = np.where(mask == 2, np.arange(s) - 7, np.arange(s)) * (mask != 0)
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask, "position_ids": pos}
    results = []
    for part in (batch, split_batch(batch, 1, 0)):
        assert part["input_ids"].shape[1] == (s if part is batch else s + 1)
        model.context_attention = core(Ring(None, [0], 0)) if part is not batch else None
        total, count = model.loss_sum(**to_tensors(part, adds_aux_loss(model.arch)))
        total.backward()
        grads = [p.grad.numpy().copy() for p in model.parameters() if p.grad is not None]
        results.append((float(total), float(count), float(model.last_aux_loss), grads))
        model.clear_gradients()
    (t0, c0, a0, g0), (t1, c1, a1, g1) = results
    assert c0 == c1 == count_targets(batch)
    np.testing.assert_allclose([t1, a1], [t0, a0], rtol=1e-6)
    assert len(g0) == len(g1) and a0 * 0.5 * c0 > 1e-2 * t0  # the aux term weighs in the loss
    for x, y in zip(g1, g0):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    model.loss_sum(**to_tensors(batch))  # right-padded rows without their mask: the padding counted
    assert packed or abs(float(model.last_aux_loss) - a0) > 1e-4


def test_a_preference_share_adds_the_whole_pairs_load_balancing_loss(tmp_path):
    """DPO (SimPO, no reference) on an MoE policy: a share through a context group of one gives the
    unsplit pair batch's loss (pair losses + coef x aux x pairs), aux and gradients."""
    model = _moe_model()
    obj = PreferenceObjective(make_config(tmp_path, dpo_loss="simpo").train, None, lambda t: t)
    batch = _batch(_pairs(3, seed=1), packed=True)
    results = []
    for part in (batch, split_batch(batch, 1, 0)):
        model.context_attention = RingCore(Ring(None, [0], 0)) if part is not batch else None
        obj.begin_step([part])
        loss, pairs = obj.loss_sum(model, part)
        loss.backward()
        grads = [p.grad.numpy().copy() for p in model.parameters() if p.grad is not None]
        results.append((float(loss), pairs, float(model.last_aux_loss), grads))
        model.clear_gradients()
    (l0, p0, a0, g0), (l1, p1, a1, g1) = results
    assert p0 == p1 == 3 and a0 > 0
    np.testing.assert_allclose([l1, a1], [l0, a0], rtol=1e-5)
    for x, y in zip(g1, g0):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5 * float(np.abs(y).max()))
