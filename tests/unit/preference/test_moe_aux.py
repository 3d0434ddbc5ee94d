"""DPO on a mixture of experts with output_router_logits: the preference objective adds router_aux_loss_coef
x the load-balancing loss of the policy forward, as TRL's DPOTrainer does (fixture from
tests/fixtures/make_moe_dpo_parity.py: TRL's _compute_loss on the tiny qwen3_moe checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.moe import with_aux_loss_settings
from bmtrain_cli.preference.batches import collate_pairs
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.reference import Precomputed
from tests.unit.preference.conftest import make_config

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE = json.loads((FIXTURES / "moe_dpo_parity.json").read_text())


def _batch(packed: bool) -> dict:
    pairs = []
    for prompt, *responses in FIXTURE["pairs"]:
        pairs.append(
            tuple(
                (np.asarray(prompt + r, np.int64), np.r_[np.zeros(len(prompt), bool), np.ones(len(r), bool)])
                for r in responses
            )
        )
    b = collate_pairs(pairs, 0, width=None, packed=packed, max_len=32)
    b["pair_ids"] = np.arange(len(pairs))
    b["ref_logps"] = np.asarray(FIXTURE["ref_logps"])
    return b


def _step_loss(tmp_path, aux: bool, packed: bool):
    """(the step's mean loss as the trainer takes it, its graph, the model) of one micro-batch of the pairs."""
    model = load_pretrained(FIXTURES / "hf" / "qwen3_moe")
    model = with_aux_loss_settings(model, ModelConfig(output_router_logits=aux))
    cfg = make_config(tmp_path, dpo_loss="sigmoid", dpo_beta=FIXTURE["beta"])
    obj = PreferenceObjective(cfg.train, Precomputed(), lambda v: v)
    batch = _batch(packed)
    pairs, _ = obj.begin_step([batch])
    loss, counted = obj.loss_sum(model, batch)
    assert counted == pairs == len(FIXTURE["pairs"])
    return float(loss) / pairs, loss / pairs, model


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_loss_with_the_load_balancing_loss_equals_trl(tmp_path, packed):
    """The mean pair loss + coef x aux equals TRL's with its aux loss on; off, TRL's without. The aux loss
    is over every unpadded token of the chosen and rejected sequences (packing them changes nothing)."""
    with_aux, _, model = _step_loss(tmp_path, True, packed)
    assert model.arch.router_aux_loss_coef == FIXTURE["router_aux_loss_coef"]
    assert float(model.last_aux_loss) == pytest.approx(FIXTURE["with_aux"]["aux_loss"], abs=1e-6)
    assert with_aux == pytest.approx(FIXTURE["with_aux"]["loss"], abs=1e-5)
    without, _, plain = _step_loss(tmp_path, False, packed)
    assert plain.last_aux_loss is None
    assert without == pytest.approx(FIXTURE["without_aux"]["loss"], abs=1e-5)
    coef_aux = FIXTURE["router_aux_loss_coef"] * FIXTURE["with_aux"]["aux_loss"]
    assert with_aux - without == pytest.approx(coef_aux, abs=1e-5)
    assert coef_aux > 1e-3  # the aux term shows


def test_the_load_balancing_loss_reaches_the_routers_gradient(tmp_path):
    grads = []
    for aux in (False, True):
        _, loss, model = _step_loss(tmp_path, aux, packed=False)
        loss.backward()
        sparse = [layer for layer in model.layers if layer.sparse]
        grads.append(np.concatenate([layer.mlp.gate.weight.grad.numpy().ravel() for layer in sparse]))
    assert np.abs(grads[1] - grads[0]).max() > 1e-6
