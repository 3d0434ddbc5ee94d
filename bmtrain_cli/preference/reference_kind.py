"""Which reference a run compares against, from its train_config alone (no Paddle: the config checks, the
setup and the memory plan read it)."""

from __future__ import annotations

from typing import Any

from bmtrain_cli.methods import method_of

# what a run's reference is (docs/preference.md "The reference"; docs/plan.md counts each)
NO_REFERENCE = "none"  # stage sft, a reference-free loss, or grpo with beta 0
FROZEN_COPY = "frozen_copy"  # full fine-tuning: a second copy of the starting weights, never trained
ADAPTERS_OFF = "adapters_off"  # LoRA: the policy with its adapters switched off (no second copy)
PRECOMPUTED = "precomputed"  # numbers computed once before training; the model used for them is dropped


def reference_kind(train: Any) -> str:
    """The reference of a train_config (its method's rule on ``dpo_loss`` or ``grpo.beta``, ``finetuning``,
    ``precompute_ref_log_probs``)."""
    if not method_of(train).reference(train):
        return NO_REFERENCE
    if train.precompute_ref_log_probs:
        return PRECOMPUTED
    return ADAPTERS_OFF if train.finetuning == "lora" else FROZEN_COPY
