"""validate-config's checks of stage: dpo (docs/preference.md): the layouts and settings a preference run
cannot use, refused before launch; called by config/checks.py."""

from __future__ import annotations

from typing import Callable, List, Tuple

from bmtrain_cli.config.derived import derive
from bmtrain_cli.config.schema import Config
from bmtrain_cli.methods import REFERENCE_FREE

PREFERENCE_FIELDS = (
    "dpo_loss",
    "dpo_beta",
    "dpo_label_smoothing",
    "simpo_gamma",
    "precompute_ref_log_probs",
)


def _pipeline_refusals(config: Config) -> List[Tuple[bool, str, str, str, str]]:
    """What stage: dpo cannot use under pipeline parallel (preference/pipeline.py): (refused, path,
    what, why, fix)."""
    t, p = config.train, config.parallel
    accumulation = derive(config).grad_accum_steps
    return [
        (
            p.pipeline_parallel > 1 and t.dpo_loss not in REFERENCE_FREE and not t.precompute_ref_log_probs,
            "parallel_config.pipeline_parallel",
            f"pipeline_parallel > 1 and a live reference model (dpo_loss: {t.dpo_loss})",
            "the reference's log-probs would need a second pass through the pipeline every step",
            "set precompute_ref_log_probs: true (computed once before training), or use dpo_loss simpo/orpo",
        ),
        (
            p.pipeline_parallel > 1
            and p.pipeline_micro_batches is not None
            and p.pipeline_micro_batches != accumulation,
            "parallel_config.pipeline_micro_batches",
            f"pipeline_micro_batches ({p.pipeline_micro_batches}) other than the gradient accumulation steps "
            f"({accumulation})",
            "each pipeline micro-batch is one micro-batch of whole pairs",
            "remove pipeline_micro_batches (it defaults to the accumulation steps)",
        ),
    ]


def check_preference(config: Config, err: Callable[..., None], warn: Callable[..., None]) -> None:
    """stage: dpo (docs/preference.md): the layouts and settings a preference run cannot use."""
    m, t, p = config.model, config.train, config.parallel
    if t.stage != "dpo":
        for name in PREFERENCE_FIELDS:
            if name in t.model_fields_set:
                warn(
                    f"train_config.{name}",
                    "not used: it applies to stage: dpo",
                    "set stage: dpo or remove it",
                )
        return
    if not m.model_name_or_path:
        err(
            "model_config.model_name_or_path",
            "stage: dpo starts from a trained model (its weights are also the reference); none is set",
            "set model_config.model_name_or_path to an SFT checkpoint, e.g. the quickstart's",
        )
    refused = _pipeline_refusals(config) + [
        (
            p.sharding_parallel > 1 and p.sharding_stage in (2, 3),
            "parallel_config.sharding_stage",
            "sharding_stage 2/3",
            "the group-sharded wrapper runs only the SFT loss forward",
            "use sharding_stage: 1",
        ),
        (
            t.to_static,
            "train_config.to_static",
            "to_static",
            "the compiled step is the SFT loss",
            "set to_static: false",
        ),
        (
            t.train_on_prompt,
            "train_config.train_on_prompt",
            "train_on_prompt",
            "the pair log-probs are over the responses only",
            "set train_on_prompt: false",
        ),
        (
            t.data_weights is not None,
            "train_config.data_weights",
            "data_weights",
            "preference files are read as one set",
            "merge the files or remove data_weights",
        ),
        (
            t.demo_data not in (None, "reverse"),
            "train_config.demo_data",
            f"demo_data: {t.demo_data}",
            "the preference demo is the reverse task",
            "use demo_data: reverse",
        ),
    ]
    for refused_here, path, what, why, fix in refused:
        if refused_here:
            err(path, f"stage: dpo cannot be combined with {what}: {why}", fix)
    if t.dpo_label_smoothing and t.dpo_loss in ("ipo", "orpo"):
        err(
            "train_config.dpo_label_smoothing",
            f"the {t.dpo_loss} loss has no label smoothing",
            "use dpo_loss: sigmoid or simpo, or set dpo_label_smoothing: 0",
        )
    if "simpo_gamma" in t.model_fields_set and t.dpo_loss != "simpo":
        warn("train_config.simpo_gamma", f"not used by dpo_loss: {t.dpo_loss}", "use dpo_loss: simpo")
    if t.precompute_ref_log_probs and t.dpo_loss in REFERENCE_FREE:
        err(
            "train_config.precompute_ref_log_probs",
            f"the {t.dpo_loss} loss is reference-free: there is nothing to precompute",
            "set precompute_ref_log_probs: false",
        )
