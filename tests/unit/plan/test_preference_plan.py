"""The memory plan of a stage dpo run (docs/plan.md "Preference runs"): two sequences per pair, the frozen
reference copy of full fine-tuning, none with LoRA (adapters off) or once precomputed, none for the
reference-free losses."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.plan.activations import no_grad_forward_bytes
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.estimator import Layout, Workload, estimate, estimate_layout, weights_exceed_device
from bmtrain_cli.preference.reference_kind import (
    ADAPTERS_OFF,
    FROZEN_COPY,
    NO_REFERENCE,
    PRECOMPUTED,
    reference_kind,
)

SEVEN_B = "configs/llama2-7b-sft-8gpu.yaml"


@pytest.fixture
def seven_b(repo_root):
    return load_config(str(repo_root / SEVEN_B)).config


def _with(cfg: Any, **train: Any) -> Any:
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def _plan(cfg: Any, **train: Any):
    return estimate(_with(cfg, **train), "A100-80GB", read_data=False)


def test_reference_kind_follows_the_train_config(seven_b) -> None:
    kind = lambda **kw: reference_kind(_with(seven_b, **kw).train)  # noqa: E731
    assert kind() == NO_REFERENCE  # sft
    assert kind(stage="dpo") == FROZEN_COPY
    assert kind(stage="dpo", finetuning="lora") == ADAPTERS_OFF
    assert kind(stage="dpo", precompute_ref_log_probs=True) == PRECOMPUTED
    assert kind(stage="dpo", dpo_loss="simpo") == NO_REFERENCE
    assert kind(stage="dpo", dpo_loss="orpo") == NO_REFERENCE


def test_dpo_full_finetuning_adds_a_weight_copy_and_doubles_the_activations(seven_b) -> None:
    sft, dpo = _plan(seven_b), _plan(seven_b, stage="dpo")
    # the frozen copy: the policy's weights once more, and no gradients or optimizer states for it
    assert sft.reference_weights == 0
    assert dpo.reference_weights == dpo.parameters == sft.parameters
    assert (dpo.gradients, dpo.optimizer_states, dpo.master_weights) == (
        sft.gradients,
        sft.optimizer_states,
        sft.master_weights,
    )
    # micro_batch_size counts pairs: twice the sequences, twice every activation
    assert dpo.activations == 2 * sft.activations
    for mode, value in sft.activations_by_recompute.items():
        assert dpo.activations_by_recompute[mode] == 2 * value
    # the peak grows by at least the copy and the second sequence's activations, and by not much more
    # than that plus the pair loss's materialised logits
    grown = dpo.peak - sft.peak
    assert grown >= dpo.reference_weights + sft.activations
    assert grown <= dpo.reference_weights + sft.activations + dpo.logits + dpo.transient
    assert any("reference copy" in line for line in dpo.lines())
    assert not any("reference copy" in line for line in sft.lines())


def test_dpo_with_lora_has_no_second_copy(seven_b) -> None:
    sft = _plan(seven_b, finetuning="lora")
    dpo = _plan(seven_b, finetuning="lora", stage="dpo")
    assert dpo.reference_weights == 0 and dpo.parameters == sft.parameters
    assert dpo.activations == 2 * sft.activations
    # more than SFT (two sequences, the reference forward), far less than a second copy of the weights
    assert sft.peak < dpo.peak < sft.peak + dpo.parameters


def test_precomputed_reference_is_not_held_through_training(seven_b) -> None:
    live = _plan(seven_b, stage="dpo")
    pre = _plan(seven_b, stage="dpo", precompute_ref_log_probs=True)
    assert pre.reference_weights == 0
    assert any("precomputed" in n for n in pre.notes)
    # the copy is gone before the first step, and no reference forward runs in the step: at most the
    # live reference's peak less the copy
    assert pre.peak <= live.peak - live.reference_weights
    # the pass before training (weights, copy, a no-gradient forward) stays below a training step, whose
    # gradients are as large as the copy
    assert pre.gradients >= live.reference_weights


def test_reference_free_losses_count_no_reference(seven_b) -> None:
    simpo = _plan(seven_b, stage="dpo", dpo_loss="simpo")
    sigmoid = _plan(seven_b, stage="dpo")
    assert simpo.reference_weights == 0
    assert simpo.activations == sigmoid.activations
    assert simpo.peak <= sigmoid.peak - sigmoid.reference_weights
    assert not any("precomputed" in n for n in simpo.notes)


def test_the_weight_check_counts_the_frozen_copy(seven_b) -> None:
    dpo = _plan(seven_b, stage="dpo")

    between = replace(dpo.device, memory_bytes=(dpo.parameters + dpo.reference_weights) - 1)
    assert weights_exceed_device(replace(dpo, device=between))
    assert not weights_exceed_device(replace(dpo, device=between, reference_weights=0))


def test_the_reference_forward_counts_where_the_loss_phase_is_the_peak(seven_b) -> None:
    """A small model on a CPU (scores kept, no recompute): the no-gradient forward of the reference runs
    while the policy's activations are held, and raises the peak by at most its own working set."""
    w = Workload.from_config(seven_b, read_data=False)
    small = replace(
        w.arch,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
    )
    base = replace(w, arch=small, seq_len=256, precision="fp32", stage="dpo", finetuning="lora")
    cpu, layout = get_device("cpu"), Layout(micro_batch=4)
    without = estimate_layout(replace(base, reference=NO_REFERENCE), layout, cpu)
    with_ref = estimate_layout(replace(base, reference=ADAPTERS_OFF), layout, cpu)
    forward = no_grad_forward_bytes(replace(base, reference=ADAPTERS_OFF), cpu, layout)
    assert without.peak < with_ref.peak <= without.peak + forward
    assert with_ref.reference_weights == 0
