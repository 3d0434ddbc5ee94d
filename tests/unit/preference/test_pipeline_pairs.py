"""The pipeline objective of stage dpo in one process: the last stage's pair loss from padded logits and
the labels it is given equals PreferenceObjective.loss_sum (loss, gradients, TRL's metrics), packed pairs
and a micro-batch without pairs included."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bmtrain_cli.preference.batches import collate_pairs
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.pipeline import PairPipeline, pipeline_rows
from bmtrain_cli.preference.reference import FrozenCopy, Precomputed
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


def _run(kind: str, pipelined: bool, micro, tmp_path):
    cfg = make_config(tmp_path, dpo_loss=kind, dpo_beta=0.5, micro_batch_size=3)
    model = tiny_model(VOCAB, seed=12)
    obj = PreferenceObjective(cfg.train, Precomputed() if kind == "sigmoid" else None, lambda v: v)
    if pipelined:
        pipe = PairPipeline(obj, SimpleNamespace(wrapping=SimpleNamespace(factory=None)), pipeline_rows(3))
        inputs, labels, pairs = pipe.pipeline_data(micro, WIDTH)
        total = 0.0
        for i in range(len(micro)):
            logits = model(inputs[0][i], inputs[1][i], inputs[2][i])
            assert logits.shape[:2] == [6, WIDTH]  # every micro-batch padded to one shape
            loss = pipe.loss_sum(logits, tuple(part[i] for part in labels))
            (loss / pairs).backward()
            total += float(loss) / pairs
    else:
        pairs, _ = obj.begin_step(micro)
        total = 0.0
        for b in micro:
            loss, _ = obj.loss_sum(model, b)
            (loss / pairs).backward()
            total += float(loss) / pairs
    grads = np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])
    return total, grads, obj.step_metrics()


@pytest.mark.parametrize("kind", ["sigmoid", "orpo"])
def test_last_stage_pair_loss_equals_one_process(tmp_path, kind):
    micro = _micro(tiny_model(VOCAB, seed=13))
    assert micro[0]["input_ids"].shape[0] < 6  # packed: fewer rows than sequences, padded up to 6
    want_loss, want_grads, want_metrics = _run(kind, False, micro, tmp_path)
    got_loss, got_grads, got_metrics = _run(kind, True, micro, tmp_path)
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(got_grads, want_grads, rtol=1e-4, atol=1e-7)
    for key, value in want_metrics.items():
        assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if kind == "sigmoid":  # the reference is another model: the precomputed numbers are used
        assert want_metrics["rewards/margins"] != 0.0


def test_a_live_reference_is_refused(tmp_path):
    cfg = make_config(tmp_path, dpo_loss="sigmoid")
    obj = PreferenceObjective(cfg.train, FrozenCopy(tiny_model(VOCAB)), lambda v: v)
    with pytest.raises(ValueError, match="precomputed reference log-probs"):
        PairPipeline(obj, SimpleNamespace(wrapping=SimpleNamespace(factory=None)), 2)
