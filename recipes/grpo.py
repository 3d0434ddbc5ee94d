"""The GRPO recipe (train_config.stage: grpo), read top to bottom: setup, before, loop, save.
docs/grpo.md describes the method.

    bmtrain train --config configs/quickstart-grpo.yaml            # runs recipe() below (stage: grpo)
    python recipes/grpo.py --config configs/quickstart-grpo.yaml    # the same (or a copy you edited)
    bmtrain train --config C --recipe my_grpo.py                    # a copy, run by `bmtrain train`

What this method owns is here: its data (prompt records, grpo/prompts.py) served as rollouts sampled from
the current policy with the model's KV-cache generator and scored by the reward functions
(grpo/rollout.py, grpo/rewards.py), its objective (TRL's clipped GRPO loss, grpo/loss.py and
grpo/objective.py) with the old policy's log-probs (num_iterations > 1) and the reference's (beta > 0:
the policy with its LoRA adapters off, or a frozen copy of the starting weights), the held-out reward
before and after, and its figures in summary.json and the closing report. The rest (model, optimizer,
checkpoints, metrics, the step) is the shared setup of bmtrain_cli.train, and the loop and the save are the
SFT recipe's (recipes/sft.py): its loop draws each step's micro-batches from the rollout source, whose
state (prompt cursor, rollouts drawn, the current rollout batch) every checkpoint keeps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, TextIO, Tuple

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "bmtrain_cli").is_dir():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.grpo.demo import write_demo_prompts
from bmtrain_cli.grpo.loss import LossSettings
from bmtrain_cli.grpo.objective import GrpoObjective, no_grad_logps
from bmtrain_cli.grpo.prompts import PromptSet, read_prompts
from bmtrain_cli.grpo.rewards import build_rewards
from bmtrain_cli.grpo.rollout import RolloutSource, Sampling
from bmtrain_cli.grpo.shard import DataShard
from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.preference.reference import FrozenCopy, load_reference_model
from bmtrain_cli.train.parts import Console, ModelParts, OptimParts, Parts, TrainData, TrainState
from bmtrain_cli.train.run import load_recipe
from bmtrain_cli.train.runtime import Runtime
from bmtrain_cli.train.setup import DemoData, train_data
from bmtrain_cli.train.setup import setup as build_parts

SFT = load_recipe("sft")  # the loop and the save (recipes/sft.py)

# ----------------------------------------------------------------------------- setup: data

# the demo task's prompts with their answers, and heldout.jsonl for the exact-match accuracy of the same
# held-out strings
PROMPT_DEMO = DemoData(
    write=lambda data_dir, task: write_demo_prompts(data_dir, task=task, seed=0),
    files={"train": "prompts_train.jsonl", "eval": "prompts_heldout.jsonl", "heldout": "heldout.jsonl"},
)


def prompt_data(rt: Runtime, tokenizer: Any, paths: Dict[str, Any], ctx: ParallelCtx) -> TrainData:
    """The prompt records as a rollout source (the training "loader"), the held-out prompts as the eval
    set; the reward functions are loaded here, before anything is trained."""
    t, g = rt.config.train, rt.config.train.grpo

    def read(split_paths: Any) -> Any:
        return read_prompts(
            split_paths,
            tokenizer,
            template=t.template,
            max_prompt_len=rt.config.model.max_seq_len - g.max_completion_length,
            truncation=t.truncation,
            on_bad_record=t.on_bad_record,
        )

    sampling = Sampling(
        num_generations=g.num_generations,
        mask_truncated_completions=g.mask_truncated_completions,
        scale_rewards=g.scale_rewards,
        decoding=SamplingOptions(
            max_new_tokens=g.max_completion_length,
            temperature=g.temperature,
            top_p=g.top_p,
            eos_token_id=tokenizer.eos_id,
        ),
    )
    source = RolloutSource(
        read(paths["train"]),
        tokenizer=tokenizer,
        rewards=build_rewards(g, Path.cwd()),
        sampling=sampling,
        micro_batch_size=t.micro_batch_size,
        micro_per_step=rt.grad_accum_steps,
        num_iterations=g.num_iterations,
        seed=t.seed,
        shuffle=t.shuffle,
        shard=DataShard(  # the ranks of a context group share one block (grpo/shard.py)
            ctx.loader_rank,
            ctx.loader_world,
            ctx.collectives.all_reduce_sum,
            ctx.context_degree,
            lead=ctx.context_ring is None or ctx.context_ring.rank == 0,
        ),
    )
    evaluation = read(paths["eval"]) if paths["eval"] is not None else None
    return train_data(rt, paths, source, evaluation)


# ----------------------------------------------------------------------------- setup: objective


def grpo_objective(
    rt: Runtime, data: TrainData, model: ModelParts, optim: OptimParts, ctx: ParallelCtx, console: Console
) -> GrpoObjective:
    """The GRPO loss; the rollout source gets the policy to sample from, the old policy's log-probs
    (num_iterations > 1) and the reference's (beta > 0)."""
    config, g = rt.config, rt.config.train.grpo
    old = no_grad_logps(model.raw, g.temperature) if g.num_iterations > 1 else None
    ref = None
    if g.beta > 0:
        if model.lora is not None:
            ref = no_grad_logps(model.raw, g.temperature, adapters_off=True)
            console.say("reference model: the policy with its LoRA adapters off")
        else:
            precision = optim.precision
            dtype = precision.dtype if precision.master_weights else None
            copy = ctx.wrapping.attach_context(load_reference_model(config, ctx.wrapping.factory, dtype))
            ctx.wrapping.shard_experts(copy)  # expert parallel: its experts split as the policy's, in step
            frozen = FrozenCopy(copy).model
            ref = no_grad_logps(frozen, g.temperature)
            console.say(f"reference model: a frozen copy of {config.model.model_name_or_path}")
    rollouts, prompts = data.loader, data.eval_loader  # as prompt_data built them
    assert isinstance(rollouts, RolloutSource) and (prompts is None or isinstance(prompts, PromptSet))
    rollouts.attach(model.raw, old, ref)
    return GrpoObjective(LossSettings.of(g), g.temperature, rollouts, prompts, g.eval_prompts)


def setup(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Tuple[Parts, TrainState]:
    """Every part of the run: prompts served as rollouts, the GRPO loss as the objective (model,
    optimizer, schedule, resume, metrics: the shared setup of train/setup.py)."""
    return build_parts(
        loaded, demo=PROMPT_DEMO, build_data=prompt_data, build_objective=grpo_objective, stream=stream
    )


# ----------------------------------------------------------------------------- before, loop, save


def reward_before(parts: Parts, state: TrainState) -> None:
    """The held-out mean reward (greedy) before the first step (kept across a resume)."""
    objective = parts.objective
    assert isinstance(objective, GrpoObjective)
    if parts.data.eval_loader is None or "eval_before" in state.history:
        return
    before = objective.held_out_reward(parts.model.raw, parts.tokenizer)
    state.history["eval_before"] = before
    parts.console.say(f"held-out mean reward before training: {before['reward']:.3f}")


def summary_fields(parts: Parts, state: TrainState) -> Dict[str, Any]:
    """The last rollout batch's reward figures, the last eval's (eval_*), before training (before_eval_*),
    and the best held-out reward (best_eval_reward: the closing report prints it in place of the best eval
    loss)."""
    objective = parts.objective
    assert isinstance(objective, GrpoObjective)
    out: Dict[str, Any] = dict(objective.source.metrics)
    out.update({f"eval_{k}": v for k, v in state.history.get("eval_rewards", {}).items()})
    out.update({f"before_eval_{k}": v for k, v in state.history.get("eval_before", {}).items()})
    if state.best_eval_loss is not None:  # the eval loss is minus the held-out mean reward
        out["best_eval_reward"] = -state.best_eval_loss
    return out


def report_lines(fields: Dict[str, Any]) -> List[str]:
    if fields.get("eval_reward") is None:
        return []
    before = fields.get("before_eval_reward")
    before_txt = f"{before:.3f}" if before is not None else "?"
    return [f"  held-out mean reward (greedy): before {before_txt} -> after {fields['eval_reward']:.3f}"]


def train(parts: Parts, state: TrainState, on_step: Optional[Any] = None) -> Dict[str, Any]:
    """Before training (the SFT recipe's lines, then the held-out reward), the SFT recipe's loop with
    this objective drawing rollouts, and its summary with this method's figures."""
    SFT.before_training(parts, state)
    reward_before(parts, state)
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
