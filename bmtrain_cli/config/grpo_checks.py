"""validate-config's checks of stage: grpo (docs/grpo.md): the settings and layouts a GRPO run cannot use,
refused before launch; called by config/checks.py."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Tuple

from bmtrain_cli.config.derived import derive
from bmtrain_cli.config.schema import Config
from bmtrain_cli.methods import BUILTIN_REWARDS


def user_reward_problem(name: str, base: Path) -> str:
    """Why a user's reward reference cannot be used, without running it ("" when it may be):
    ``file.py:function`` must name an existing file (relative to ``base``); ``module:function`` both parts."""
    where, sep, function = name.rpartition(":")
    if not sep or not where or not function.isidentifier():
        builtins = ", ".join(BUILTIN_REWARDS)
        return f"{name!r} is neither a built-in reward ({builtins}) nor file.py:function / module:function"
    if where.endswith(".py"):
        path = Path(where) if Path(where).is_absolute() else base / where
        if not path.is_file():
            return f"reward file {path} does not exist"
    return ""


def _layout_refusals(config: Config) -> List[Tuple[bool, str, str, str]]:
    """(refused, path, what, fix) of the layouts and settings a GRPO run does not take."""
    t, p = config.train, config.parallel
    return [
        (
            p.tensor_parallel > 2
            or (p.tensor_parallel > 1 and (p.data_parallel > 2 or p.sharding_parallel > 1)),
            "parallel_config.tensor_parallel",
            f"tensor_parallel {p.tensor_parallel} with data_parallel {p.data_parallel} and "
            f"sharding_parallel {p.sharding_parallel}: tensor parallel is checked against one process at "
            "tensor_parallel 2, alone or with data_parallel 2",
            "tensor_parallel: 2 with data_parallel 1 or 2 and sharding_parallel: 1, or tensor_parallel: 1",
        ),
        (
            p.pipeline_parallel > 1,
            "parallel_config.pipeline_parallel",
            "pipeline_parallel > 1: the rollouts run the whole model on each rank",
            "pipeline_parallel: 1",
        ),
        (
            p.sharding_parallel > 1 and p.sharding_stage in (2, 3),
            "parallel_config.sharding_stage",
            f"sharding_stage {p.sharding_stage}: the group-sharded wrapper runs only the SFT loss forward",
            "sharding_stage: 1",
        ),
        (
            t.to_static,
            "train_config.to_static",
            "to_static: the compiled step is the SFT loss",
            "to_static: false",
        ),
        (
            t.streaming is True,
            "train_config.streaming",
            "streaming: the prompt records are read whole before training",
            "streaming: false (or auto)",
        ),
        (
            t.demo_data not in (None, "reverse"),
            "train_config.demo_data",
            f"demo_data: {t.demo_data}: the GRPO demo is the reverse task",
            "demo_data: reverse",
        ),
    ]


def check_grpo(config: Config, err: Callable[..., None]) -> None:
    """stage: grpo: whole groups per step, one weight per reward function, rewards that exist, a
    reference to compare with when beta > 0, and the layouts it runs under (data parallel and sharding
    stage 1, tensor parallel 2 alone or with data parallel 2; docs/grpo.md)."""
    m, t = config.model, config.train
    g = t.grpo
    if t.stage != "grpo":
        if "grpo" in t.model_fields_set:
            err(
                "train_config.grpo",
                f"applies to stage: grpo (this run is stage: {t.stage})",
                "set stage: grpo or remove it",
            )
        return
    for refused, path, what, fix in _layout_refusals(config):
        if refused:
            err(path, f"stage: grpo cannot be combined with {what}", f"set {fix}")
    if not g.reward_funcs:
        err(
            "train_config.grpo.reward_funcs",
            "stage: grpo needs at least one reward function",
            "e.g. reward_funcs: [accuracy] (the final answer against the answer column), or path/to/file.py:name",
        )
    for i, name in enumerate(g.reward_funcs):
        problem = "" if name in BUILTIN_REWARDS else user_reward_problem(name, Path.cwd())
        if problem:
            err(f"train_config.grpo.reward_funcs.{i}", problem, "see docs/grpo.md, Rewards")
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        err(
            "train_config.grpo.reward_weights",
            f"{len(g.reward_weights)} weights for {len(g.reward_funcs)} reward functions",
            "give one weight per entry of reward_funcs, in the same order",
        )
    derived = derive(config)
    if derived.global_batch_size % g.num_generations:
        where = "global_batch_size" if t.global_batch_size else "micro_batch_size"
        err(
            f"train_config.{where}",
            f"a step's {derived.global_batch_size} completions do not hold whole groups of num_generations "
            f"({g.num_generations}): the advantages compare completions of the same prompt",
            f"use a multiple of {g.num_generations} completions per step",
        )
    if g.beta > 0 and t.finetuning == "full" and not m.model_name_or_path:
        err(
            "train_config.grpo.beta",
            "beta > 0 compares with the starting weights as the reference, and a fresh model has none on disk",
            "set model_config.model_name_or_path (e.g. the quickstart's checkpoint), use finetuning: lora, or beta: 0",
        )
    if g.max_completion_length >= m.max_seq_len:
        err(
            "train_config.grpo.max_completion_length",
            f"max_completion_length ({g.max_completion_length}) leaves no room for a prompt in max_seq_len "
            f"({m.max_seq_len})",
            "raise model_config.max_seq_len or lower max_completion_length",
        )
