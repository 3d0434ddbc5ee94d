"""The pipeline objective of stage dpo in one process: the last stage's pair loss from padded logits and
the labels it is given equals PreferenceObjective.loss_sum (loss, gradients, TRL's metrics), packed pairs
and a micro-batch without pairs included; on a mixture of experts with output_router_logits, the
pipeline items in a row carry the routers' sums to the last stage's loss (parallel/pipeline.py), which
adds the load-balancing term and logs it as one process does."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from bmtrain_cli.models import build
from bmtrain_cli.parallel.pipeline import _build_items, _PipelineLoss
from bmtrain_cli.preference.batches import collate_pairs
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.pipeline import PairPipeline, pipeline_rows
from bmtrain_cli.preference.reference import FrozenCopy, Precomputed
from tests.tiny import ARCH
from tests.unit.preference.conftest import make_config, tiny_model
from tests.unit.preference.test_objective import VOCAB, _batch, _pairs

WIDTH = 32


def _micro(reference_model):
    pairs = _pairs(5, seed=11)
    empty = collate_pairs([], 0, width=None, packed=True, max_len=24)
    empty["pair_ids"] = np.zeros(0, dtype=np.int64)
    micro = [_batch(pairs[:3], True), _batch(pairs[3:], True, start=3), empty]
    for b in micro:
        n = 2 * len(b["pair_ids"])
        ref = FrozenCopy(reference_model).logps(b, n).numpy() if n else np.zeros(0, np.float32)
        b["ref_logps"] = ref.reshape(-1, 2)
    return micro


MOE = dataclasses.replace(
    ARCH,
    family="qwen3_moe",
    vocab_size=VOCAB,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    output_router_logits=True,
    router_aux_loss_coef=0.5,
)


def _policy(moe: bool):
    if not moe:
        return tiny_model(VOCAB, seed=12)
    paddle.seed(12)
    return build(MOE, kernels="reference")


def _run(kind: str, pipelined: bool, micro, tmp_path, moe: bool = False):
    """(step loss, gradients, TRL's metrics, each micro-batch's logged load-balancing loss)."""
    cfg = make_config(tmp_path, dpo_loss=kind, dpo_beta=0.5, micro_batch_size=3)
    model = _policy(moe)
    obj = PreferenceObjective(cfg.train, Precomputed() if kind == "sigmoid" else None, lambda v: v)
    auxes = []
    if pipelined:
        ctx = SimpleNamespace(
            wrapping=SimpleNamespace(factory=None),
            context_ring=None,
            collectives=SimpleNamespace(context_share=lambda batch: batch),  # no context group
        )
        pipe = PairPipeline(obj, ctx, pipeline_rows(3))
        last = _PipelineLoss(ctx, model.arch)  # the last stage's loss: the pairs' and the routers' term
        last.objective = pipe
        items = _build_items(model).layers
        inputs, labels, pairs = pipe.pipeline_data(micro, WIDTH)
        total = 0.0
        for i in range(len(micro)):
            x = (inputs[0][i], inputs[1][i], inputs[2][i])
            for item in items:  # the stages in a row: (logits, routers' sums) reach the last
                x = item(x)
            assert (x[0] if moe else x).shape[:2] == [6, WIDTH]  # every micro-batch padded to one shape
            loss = last(x, tuple(part[i] for part in labels))
            (loss / pairs).backward()
            total += float(loss) / pairs
        auxes = [float(a) for a in last.auxes]
    else:
        pairs, _ = obj.begin_step(micro)
        total = 0.0
        for b in micro:
            loss, _ = obj.loss_sum(model, b)
            (loss / pairs).backward()
            total += float(loss) / pairs
            if model.last_aux_loss is not None:
                auxes.append(float(model.last_aux_loss))
    grads = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    return total, grads, obj.step_metrics(), auxes


@pytest.mark.parametrize("kind", ["sigmoid", "orpo"])
def test_last_stage_pair_loss_equals_one_process(tmp_path, kind):
    micro = _micro(tiny_model(VOCAB, seed=13))
    assert micro[0]["input_ids"].shape[0] < 6  # packed: fewer rows than sequences, padded up to 6
    want_loss, want_grads, want_metrics, _ = _run(kind, False, micro, tmp_path)
    got_loss, got_grads, got_metrics, _ = _run(kind, True, micro, tmp_path)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(got_grads, want_grads, rtol=1e-4, atol=1e-7)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if kind == "sigmoid":  # the reference is another model: the precomputed numbers are used
        assert want_metrics["rewards/margins"] != 0.0


@pytest.mark.parametrize("kind", ["sigmoid", "orpo"])
def test_last_stage_adds_the_load_balancing_loss_as_one_process(tmp_path, kind):
    micro = _micro(tiny_model(VOCAB, seed=13))
    want_loss, want_grads, want_metrics, want_aux = _run(kind, False, micro, tmp_path, moe=True)
    got_loss, got_grads, got_metrics, got_aux = _run(kind, True, micro, tmp_path, moe=True)
    # every micro-batch's policy forward logs its aux (the one without pairs too, weighed 0 in the loss)
    assert len(want_aux) == len(micro) and min(want_aux) > 0
    np.testing.assert_allclose(got_aux, want_aux, rtol=1e-5)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    # the term is there: the pair loss alone is off by coef x aux per pair on average
    pair_only = want_loss - MOE.router_aux_loss_coef * (want_aux[0] * 3 + want_aux[1] * 2) / 5
    assert abs(got_loss - pair_only) > 1e-3
    np.testing.assert_allclose(got_grads, want_grads, rtol=1e-4, atol=1e-7)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_a_live_reference_is_refused(tmp_path):
    cfg = make_config(tmp_path, dpo_loss="sigmoid")
    obj = PreferenceObjective(cfg.train, FrozenCopy(tiny_model(VOCAB)), lambda v: v)
    with pytest.raises(ValueError, match="precomputed reference log-probs"):
        PairPipeline(obj, SimpleNamespace(wrapping=SimpleNamespace(factory=None)), 2)
