"""Which parallel layouts a config admits: the validation checks (config/checks.py) run on the config with
its parallel axes replaced. `bmtrain plan --search` ranks only layouts that `validate-config` would accept,
so the search holds no second copy of the rules."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

from bmtrain_cli.config.checks import check_config
from bmtrain_cli.config.schema import Config

# the parallel_config keys a layout sets, in the order of a layout key
AXES = (
    "data_parallel",
    "tensor_parallel",
    "pipeline_parallel",
    "sharding_parallel",
    "sharding_stage",
    "context_parallel",
    "expert_parallel",
)


def layout_admission(config: Config, has_gpu: bool) -> Callable[[Tuple[int, ...]], bool]:
    """A predicate on layouts given as the values of :data:`AXES`: whether ``config`` with those axes passes
    every check ``validate-config`` makes (on a GPU build when ``has_gpu``). Answers are cached per layout."""
    answers: Dict[Tuple[int, ...], bool] = {}

    def admits(axes: Tuple[int, ...]) -> bool:
        if axes not in answers:
            update: Dict[str, Any] = dict(zip(AXES, axes))
            if update["pipeline_parallel"] == 1:
                update["pipeline_micro_batches"] = None  # a pipeline setting of the config's own layout
            parallel = config.parallel.model_copy(update=update)
            candidate = config.model_copy(update={"parallel": parallel})
            problems = check_config(candidate, mode="validate", has_gpu=has_gpu)
            answers[axes] = not any(p.severity == "error" for p in problems)
        return answers[axes]

    return admits
