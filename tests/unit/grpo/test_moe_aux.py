"""GRPO on a mixture of experts with output_router_logits: the objective adds router_aux_loss_coef x the
load-balancing loss of each micro-batch's policy forward, as TRL 1.16's GRPOTrainer does (fixture from
tests/fixtures/make_moe_grpo_parity.py: TRL's _compute_loss, with its own policy forward, on the tiny
qwen3_moe checkpoint over one step of two micro-batches, a truncated completion masked out)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.grpo.loss import LossSettings
from bmtrain_cli.grpo.objective import GrpoObjective, routed_mask
from bmtrain_cli.grpo.rollout import pack
from bmtrain_cli.grpo.shard import DataShard
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.moe import with_aux_loss_settings
from bmtrain_cli.parallel.ring_attention import split_batch

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
FIXTURE = json.loads((FIXTURES / "moe_grpo_parity.json").read_text())


def _micro_batches() -> list:
    f = FIXTURE
    batch = pack(f["prompts"], f["completions"])
    batch["completion_mask"] = batch["completion_mask"] * ~np.asarray(f["truncated"])[:, None]
    batch["advantages"] = np.asarray(f["advantages"], np.float32)
    batch["old_logps"] = np.asarray(f["old_logps"], np.float32)
    batch["ref_logps"] = np.asarray(f["ref_logps"], np.float32)
    m = f["micro_batch_size"]
    return [{k: v[i : i + m] for k, v in batch.items()} for i in range(0, len(f["prompts"]), m)]


def _model(aux: bool):
    model = load_pretrained(FIXTURES / "hf" / "qwen3_moe")
    return with_aux_loss_settings(model, ModelConfig(output_router_logits=aux))


def _objective(loss_type: str) -> GrpoObjective:
    f = FIXTURE
    settings = LossSettings(
        loss_type=loss_type,
        epsilon_low=f["epsilon_low"],
        epsilon_high=f["epsilon_high"],
        beta=f["beta"],
        importance_sampling_level="token",
        max_completion_length=f["max_completion_length"],
    )
    source = types.SimpleNamespace(shard=DataShard())
    return GrpoObjective(settings, f["temperature"], source, None, 0)  # type: ignore[arg-type]


def _step(loss_type: str, aux: bool):
    """(the step's loss as the trainer takes it, each micro-batch's logged aux loss, the model after backward)."""
    model, obj = _model(aux), _objective(loss_type)
    micro = _micro_batches()
    count, _ = obj.begin_step(micro)
    total, logged = 0.0, []
    for b in micro:
        loss, _ = obj.loss_sum(model, b)
        (loss / count).backward()
        total += float(loss) / count
        logged.append(None if model.last_aux_loss is None else float(model.last_aux_loss))
    return total, logged, model


def _router_grads(model) -> list:
    return [layer.mlp.gate.weight.grad.numpy() for layer in model.layers if layer.sparse]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_step_loss_with_the_load_balancing_loss_equals_trl(loss_type):
    """The step's loss, each micro-batch's aux loss and the routers' gradient equal TRL's."""
    want = FIXTURE["cases"][loss_type]
    loss, logged, model = _step(loss_type, aux=True)
    assert model.arch.router_aux_loss_coef == FIXTURE["router_aux_loss_coef"]
    np.testing.assert_allclose(logged, want["aux_loss"], rtol=0, atol=1e-6)
    assert loss == pytest.approx(want["loss"], abs=1e-5)
    grads = _router_grads(model)
    assert len(grads) == len(want["router_grads"]) == 2
    for got, ref in zip(grads, want["router_grads"]):
        ref = np.asarray(ref)  # torch's [experts, hidden]
        got = got.T if got.shape != ref.shape else got
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6)


def test_without_output_router_logits_the_loss_is_trls_without_aux_and_the_aux_term_shows():
    loss, logged, _ = _step("grpo", aux=False)
    assert logged == [None, None]
    want = FIXTURE["cases"]
    assert loss == pytest.approx(want["grpo/without_aux"]["loss"], abs=1e-5)
    coef_aux = FIXTURE["router_aux_loss_coef"] * float(np.mean(want["grpo"]["aux_loss"]))
    assert want["grpo"]["loss"] - loss == pytest.approx(coef_aux, abs=1e-5)
    assert coef_aux > 1e-2


def test_the_routed_tokens_are_the_prompt_and_kept_completion_tokens_and_a_share_holds_its_columns():
    batch = pack([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    batch["completion_mask"][1] = 0  # a truncated completion that mask_truncated_completions drops
    mask = routed_mask(batch)
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    for rank in (0, 1):
        share = split_batch(batch, 2, rank)
        cols = share["context_columns"]
        padded = np.pad(mask, ((0, 0), (0, 8 - mask.shape[1])))
        assert (routed_mask(share) == padded[:, cols]).all()
        assert routed_mask(share).shape == share["input_ids"].shape


def test_a_context_share_through_a_ring_of_one_adds_the_whole_micro_batch_aux_loss():
    """Under context parallel each rank routes its share's columns (padded to the ring's width) and the
    routers' sums are summed over the group: through a ring of one, the loss and aux loss of one process."""
    from bmtrain_cli.parallel.ring_attention import Ring, RingCore

    results = []
    for share in (False, True):
        model, obj = _model(aux=True), _objective("grpo")
        if share:
            model.context_attention = RingCore(Ring(None, [0], 0))
        micro = [split_batch(b, 1, 0) if share else b for b in _micro_batches()]
        obj.begin_step(micro)
        loss, _ = obj.loss_sum(model, micro[0])
        results.append((float(loss), float(model.last_aux_loss)))
    assert results[1][0] == pytest.approx(results[0][0], abs=1e-5)
    assert results[1][1] == pytest.approx(results[0][1], abs=1e-6)
    assert results[0][1] == pytest.approx(FIXTURE["cases"]["grpo"]["aux_loss"][0], abs=1e-6)
