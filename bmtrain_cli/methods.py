"""The training methods: ``train_config.stage`` -> the recipe that trains it. The one place a stage is
looked up (the config checks that belong to a stage aside: config/checks.py, config/preference_checks.py,
config/grpo_checks.py).

A method is a recipe file, ``recipes/<stage>.py`` (a wheel carries them as ``bmtrain_cli/_recipes``),
which builds its own data and objective from the shared pieces of bmtrain_cli.train, plus what the tools
that read a run's data before it starts (the memory plan, data-preview, prepare-data, data-stats) need to
know of its samples. Adding a method is one entry here, one recipe file, and its config checks
(docs/architecture.md, "Where to add a method").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Literal, Tuple

_PACKAGE = Path(__file__).resolve().parent

REFERENCE_FREE = ("simpo", "orpo")  # the dpo_loss values that compare against no reference model
# the metrics of stage dpo, named as TRL logs them (preference/objective.py computes them, train/monitoring/metrics.py
# writes them)
PREFERENCE_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "preference_accuracy",
)
# stage grpo's held-out reward: prompts per greedy generate() call (grpo/objective.py; plan/rollout.py counts
# its KV cache)
GRPO_EVAL_ROWS = 64
# the reward functions of stage grpo named by a word (grpo/rewards.py builds them)
BUILTIN_REWARDS = ("accuracy", "format", "overlong")


@dataclass(frozen=True)
class Method:
    recipe: str  # recipes/<recipe>.py
    # what one training sample is: "sequence" (an SFT record: one token sequence), "pair" (a preference
    # pair: the chosen and the rejected conversation, two sequences; micro_batch_size counts pairs) or
    # "completion" (a prompt record's sampled completion, one sequence; micro_batch_size counts completions,
    # each prompt giving train_config.grpo.num_generations of them)
    sample: Literal["sequence", "pair", "completion"]
    # whether a train_config of this method compares against a reference model (preference/reference_kind.py)
    reference: Callable[[Any], bool]

    @property
    def sequences_per_sample(self) -> int:
        return 2 if self.sample == "pair" else 1


METHODS: Dict[str, Method] = {
    "sft": Method(recipe="sft", sample="sequence", reference=lambda t: False),
    "dpo": Method(recipe="dpo", sample="pair", reference=lambda t: t.dpo_loss not in REFERENCE_FREE),
    "grpo": Method(recipe="grpo", sample="completion", reference=lambda t: t.grpo.beta > 0),
}
STAGES: Tuple[str, ...] = tuple(METHODS)  # train_config.stage's choices (config/schema.py)


def method_of(train: Any) -> Method:
    """The method of a train_config (its ``stage``)."""
    return METHODS[train.stage]


def recipe_path(name: str) -> Path:
    """A built-in recipe: an installed package's copy (bmtrain_cli/_recipes/NAME.py), else the checkout's
    recipes/NAME.py."""
    packaged = _PACKAGE / "_recipes" / f"{name}.py"
    return packaged if packaged.is_file() else _PACKAGE.parent / "recipes" / f"{name}.py"


def recipe_file(train: Any) -> Path:
    """The recipe a run executes: train_config.recipe when set (a user's file), else its stage's."""
    if train.recipe is not None:
        return Path(train.recipe).resolve()
    return recipe_path(method_of(train).recipe).resolve()


def builtin_recipe_stage(path: Path) -> str:
    """The stage whose built-in recipe ``path`` is ("" for any other file)."""
    resolved = path.resolve()
    for stage, method in METHODS.items():
        if recipe_path(method.recipe).resolve() == resolved:
            return stage
    return ""
