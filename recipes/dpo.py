"""The preference recipe (train_config.stage: dpo; DPO, IPO, SimPO, ORPO), read top to bottom: setup,
step, loop, save. docs/preference.md describes the method.

    bmtrain train --config configs/quickstart-dpo.yaml            # runs recipe() below (stage: dpo)
    python recipes/dpo.py --config configs/quickstart-dpo.yaml    # the same (or a copy you edited)
    bmtrain train --config C --recipe my_dpo.py                   # a copy, run by `bmtrain train`

What this method owns is here: its data (preference pairs, two sequences each), its objective (the pair
loss of train_config.dpo_loss) with its reference (a frozen copy of the starting weights, the policy with
its LoRA adapters off, or log-probs precomputed once), the held-out preference accuracy before training,
and its figures in summary.json and the closing report. The rest (model, optimizer, parallel wrappers,
checkpoints, metrics, the step) is the shared setup of bmtrain_cli.train, and the loop and the save are
the SFT recipe's (recipes/sft.py), run with this objective.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO, Tuple

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "bmtrain_cli").is_dir():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.methods import REFERENCE_FREE
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.preference.demo import write_demo_pairs
from bmtrain_cli.preference.loader import PreferenceLoader, build_preference_loader
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.pipeline import PairPipeline, pipeline_rows
from bmtrain_cli.preference.reference import (
    AdaptersOff,
    FrozenCopy,
    Precomputed,
    Reference,
    load_reference_model,
    precompute,
    precompute_key,
)
from bmtrain_cli.train.parts import Console, ModelParts, OptimParts, Parts, TrainData, TrainState
from bmtrain_cli.train.run import load_recipe
from bmtrain_cli.train.runtime import Runtime
from bmtrain_cli.train.setup import DemoData, data_config, train_data
from bmtrain_cli.train.setup import setup as build_parts

SFT = load_recipe("sft")  # the loop and the save (recipes/sft.py)

# ----------------------------------------------------------------------------- setup: data

# the demo task's pairs (the correct reversal of a string against a near miss), and heldout.jsonl for the
# exact-match accuracy of the same held-out strings
PAIR_DEMO = DemoData(
    write=lambda data_dir, task: write_demo_pairs(data_dir, task=task, seed=0),
    files={"train": "pairs_train.jsonl", "eval": "pairs_heldout.jsonl", "heldout": "heldout.jsonl"},
)


def pair_data(rt: Runtime, tokenizer: Any, paths: Dict[str, Any], ctx: ParallelCtx) -> TrainData:
    """This data rank's pair loaders: {"prompt", "chosen", "rejected"} records, each pair two sequences."""
    config = data_config(rt, paths)

    def loader(split: str) -> Any:
        return build_preference_loader(
            config, tokenizer, split=split, data_rank=ctx.loader_rank, data_world=ctx.loader_world
        )

    evaluation = loader("eval") if paths["eval"] is not None else None
    return train_data(rt, paths, loader("train"), evaluation)


# ----------------------------------------------------------------------------- setup: objective


class PairLoss(PreferenceObjective):
    """The pair loss as the shared step, evaluation and report call it (train/parts.py Objective):
    preference/objective.py's arithmetic, fleet's pipeline schedule through preference/pipeline.py, and
    the eval on pairs with TRL's metrics."""

    perplexity = False  # a pair loss is no token NLL: no eval ppl

    def pipeline(self, ctx: ParallelCtx, micro_batch_size: int) -> PairPipeline:
        return PairPipeline(self, ctx, pipeline_rows(micro_batch_size))

    def evaluate(self, parts: Parts, state: TrainState) -> Tuple[float, Dict[str, float]]:
        """Mean pair loss and TRL's metrics on the eval pairs (collective); the metrics are kept in
        state.history["eval_metrics"] for the summary."""
        loss, extra = self.evaluate_pairs(
            scoring_model(parts), parts.data.eval_loader, parts.optim.precision.autocast
        )
        state.history["eval_metrics"] = extra
        return loss, extra


def scoring_model(parts: Parts) -> Any:
    """The model pairs are scored with: the training model itself, tensor-parallel shards included; under
    pipeline or expert parallel (collective) a gathered copy with the whole weights on every rank, as
    SFT's eval (each rank scores its own share of the eval pairs, however many, with no dispatch)."""
    if parts.ctx.pp_degree > 1 or parts.ctx.expert_group is not None:
        return parts.ctx.wrapping.gather_full_model(parts.model.wrapped, kernels=parts.config.model.kernels)
    return parts.model.wrapped


def pair_loss(
    rt: Runtime, data: TrainData, model: ModelParts, optim: OptimParts, ctx: ParallelCtx, console: Console
) -> PairLoss:
    """The objective of train_config.dpo_loss with its reference. With precompute_ref_log_probs the
    reference log-probs of every pair are attached to the loaders' data and the frozen copy is dropped."""
    config, t = rt.config, rt.config.train
    reference: Optional[Reference] = None
    if t.dpo_loss not in REFERENCE_FREE:
        lora = model.lora is not None
        if lora:
            live: Reference = AdaptersOff(model.raw)
            what = "the policy with its LoRA adapters off"
        else:
            precision = optim.precision
            dtype = precision.dtype if precision.master_weights else None
            live = FrozenCopy(
                ctx.wrapping.attach_context(load_reference_model(config, ctx.wrapping.factory, dtype))
            )
            what = f"a frozen copy of {config.model.model_name_or_path}"
        if t.precompute_ref_log_probs:
            for loader in (ld for ld in (data.loader, data.eval_loader) if ld is not None):
                assert isinstance(loader, PreferenceLoader)  # as pair_data built them
                path = precompute(loader, live, precompute_key(config, loader.dataset), ctx.is_main)
                console.say(f"reference log-probs of {len(loader.dataset):,} pairs ({what}): {path}")
            reference = Precomputed()
        else:
            console.say(f"reference model: {what}")
            reference = live
    return PairLoss(t, reference, ctx.collectives.all_reduce_sum)


def setup(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Tuple[Parts, TrainState]:
    """Every part of the run: preference pairs as data, the pair loss with its reference as the objective
    (model, optimizer, parallel wrappers, schedule, resume, metrics: the shared setup of train/setup.py)."""
    return build_parts(loaded, demo=PAIR_DEMO, build_data=pair_data, build_objective=pair_loss, stream=stream)


# ----------------------------------------------------------------------------- before, loop, save


def preference_accuracy_before(parts: Parts, state: TrainState) -> None:
    """The held-out preference figures before the first step (kept across a resume)."""
    if parts.data.eval_loader is None or "eval_before" in state.history:
        return
    objective = parts.objective
    assert isinstance(objective, PairLoss)
    _, before = objective.evaluate_pairs(
        scoring_model(parts), parts.data.eval_loader, parts.optim.precision.autocast
    )
    state.history["eval_before"] = before
    parts.console.say(
        f"held-out preference accuracy before training: {100 * before['preference_accuracy']:.1f}%"
    )


def summary_fields(parts: Parts, state: TrainState) -> Dict[str, Any]:
    """TRL's metrics of the last step, of the last eval (eval_*) and before training (before_eval_*)."""
    objective = parts.objective
    assert isinstance(objective, PairLoss)
    out: Dict[str, Any] = dict(objective.last_metrics)
    out.update({f"eval_{k}": v for k, v in state.history.get("eval_metrics", {}).items()})
    out.update({f"before_eval_{k}": v for k, v in state.history.get("eval_before", {}).items()})
    return out


def report_lines(fields: Dict[str, Any]) -> List[str]:
    if fields.get("eval_preference_accuracy") is None:
        return []
    before = fields.get("before_eval_preference_accuracy")
    before_txt = f"{100 * before:.1f}%" if before is not None else "?"
    after = 100 * fields["eval_preference_accuracy"]
    return [f"  held-out preference accuracy: before {before_txt} -> after {after:.1f}%"]


def train(parts: Parts, state: TrainState, on_step: Optional[Any] = None) -> Dict[str, Any]:
    """Before training (the SFT recipe's lines, then the preference accuracy), the SFT recipe's loop with
    this objective, and its summary with this method's figures; returns summary.json's content."""
    SFT.before_training(parts, state)
    preference_accuracy_before(parts, state)
    parts, meter, checkpoint, final_eval = SFT.loop(parts, state, on_step)
    fields = summary_fields(parts, state)
    return SFT.finish(parts, state, meter, checkpoint, final_eval, fields, report_lines(fields))


def recipe(
    loaded: LoadedConfig, stream: Optional[TextIO] = None, on_step: Optional[Any] = None
) -> Dict[str, Any]:
    """setup, then training; metrics are closed however it ends."""
    parts, state = setup(loaded, stream=stream)
    try:
        return train(parts, state, on_step)
    finally:
        parts.metrics.close()


if __name__ == "__main__":
    from bmtrain_cli.cli import run_recipe_script

    run_recipe_script(sys.modules[__name__])  # `bmtrain train --recipe THIS_FILE` with this file's arguments
