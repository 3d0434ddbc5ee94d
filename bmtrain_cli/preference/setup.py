"""Building the preference parts for the trainer: the pair loaders and the objective with its reference."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from bmtrain_cli.preference.loader import PreferenceLoader, build_preference_loader
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.reference import (
    AdaptersOff,
    FrozenCopy,
    Precomputed,
    Reference,
    load_reference_model,
    precompute,
    precompute_key,
)
from bmtrain_cli.preference.reference_kind import REFERENCE_FREE


def build_loaders(
    config: Any, tokenizer: Any, data_rank: int, data_world: int, has_eval: bool
) -> Tuple[PreferenceLoader, Optional[PreferenceLoader]]:
    """(training loader, eval loader or None) of one data rank."""
    train = build_preference_loader(
        config, tokenizer, split="train", data_rank=data_rank, data_world=data_world
    )
    evaluation = (
        build_preference_loader(config, tokenizer, split="eval", data_rank=data_rank, data_world=data_world)
        if has_eval
        else None
    )
    return train, evaluation


def build_objective(
    config: Any,
    model: Any,
    *,
    lora: bool,
    factory: Any,
    dtype: Optional[str],
    loaders: Tuple[PreferenceLoader, Optional[PreferenceLoader]],
    all_reduce: Callable[[Any], Any],
    is_main: bool,
    say: Callable[[str], None],
) -> PreferenceObjective:
    """The objective of train_config.dpo_loss; with precompute_ref_log_probs the reference log-probs of
    every pair are attached to the loaders' data and the frozen copy is dropped again."""
    t = config.train
    reference: Optional[Reference] = None
    if t.dpo_loss not in REFERENCE_FREE:
        live: Reference = (
            AdaptersOff(model) if lora else FrozenCopy(load_reference_model(config, factory, dtype))
        )
        what = (
            "the policy with its LoRA adapters off"
            if lora
            else f"a frozen copy of {config.model.model_name_or_path}"
        )
        if t.precompute_ref_log_probs:
            for loader in (ld for ld in loaders if ld is not None):
                path = precompute(loader, live, precompute_key(config, loader.dataset), is_main)
                say(f"reference log-probs of {len(loader.dataset):,} pairs ({what}): {path}")
            reference = Precomputed()
        else:
            say(f"reference model: {what}")
            reference = live
    return PreferenceObjective(t, reference, all_reduce)
