"""Reward functions of stage grpo (train_config.grpo.reward_funcs, docs/grpo.md).

A reward function is called once per rollout batch as ``f(prompts, completions, **columns)``: ``prompts``
and ``completions`` are lists of strings (a prompt repeated once per completion of its group), each column
of the prompt records (``answer``, ...) a list of the same length; it returns one float per completion.
Built-ins are named by a word (methods.py ``BUILTIN_REWARDS``); a user's function by ``path/to/file.py:name`` or
``module:name``. A function that raises, returns something other than a list of len(completions) numbers,
or returns a non-finite number stops the run with its name and the record (RewardError), never a zero.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Sequence

from bmtrain_cli.errors import UserError
from bmtrain_cli.methods import BUILTIN_REWARDS

RewardFn = Callable[..., Any]

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class RewardError(UserError):
    """A reward function failed or broke its contract; the message names it and the record (the CLI
    prints it as one line and exits 2)."""


def final_answer(completion: str) -> str:
    """The answer a completion gives: the last ``<answer>...</answer>`` when it has one, else its text,
    whitespace-stripped."""
    tagged = ANSWER_TAG.findall(completion)
    return (tagged[-1] if tagged else completion).strip()


def accuracy_reward(column: str) -> RewardFn:
    """1.0 when a completion's final answer equals the record's ``column`` (both as stripped strings)."""

    def accuracy(prompts: List[str], completions: List[str], **columns: Any) -> List[float]:
        if column not in columns:
            raise KeyError(f'the prompt records have no "{column}" column (train_config.grpo.answer_column)')
        return [float(final_answer(c) == str(a).strip()) for c, a in zip(completions, columns[column])]

    return accuracy


def format_reward(pattern: str) -> RewardFn:
    """1.0 when the whole completion (stripped) matches ``pattern`` (dot matches newline)."""
    compiled = re.compile(pattern, re.DOTALL)

    def format(prompts: List[str], completions: List[str], **columns: Any) -> List[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return format


def overlong_reward(max_length: int, buffer: int) -> RewardFn:
    """DAPO's soft overlong punishment on completion lengths in tokens (``completion_lengths``, passed by
    the rollout): 0 up to max_length - buffer, then linearly down to -1 at max_length; a completion cut
    at max_length without its end-of-sequence token gets -1."""

    def overlong(
        prompts: List[str],
        completions: List[str],
        *,
        completion_lengths: List[int],
        truncated: List[bool],
        **_: Any,
    ) -> List[float]:
        out = []
        for n, cut in zip(completion_lengths, truncated):
            if cut:
                out.append(-1.0)
            elif buffer and n > max_length - buffer:
                out.append(-(n - (max_length - buffer)) / buffer)
            else:
                out.append(0.0)
        return out

    return overlong


def load_user_function(name: str, base: Path) -> RewardFn:
    """The function ``file.py:function`` (a path relative to ``base``) or ``module:function``."""
    where, _, function = name.rpartition(":")
    if where.endswith(".py"):
        path = (Path(where) if Path(where).is_absolute() else base / where).resolve()
        module_name = f"bmtrain_user_rewards_{abs(hash(str(path)))}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise RewardError(f"reward {name}: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise RewardError(f"reward {name}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise RewardError(
                f"reward {name}: importing {where} failed: {type(exc).__name__}: {exc}"
            ) from exc
    fn = getattr(module, function, None)
    if not callable(fn):
        raise RewardError(f"reward {name}: {where} has no function {function}")
    return fn


@dataclass(frozen=True)
class Reward:
    name: str  # as logged: rewards/<name>/mean
    weight: float
    fn: RewardFn


def build_rewards(grpo: Any, base: Path) -> List[Reward]:
    """The reward functions of a train_config.grpo section (``base``: where relative file names start)."""
    weights = grpo.reward_weights or [1.0] * len(grpo.reward_funcs)
    made: Dict[str, Callable[[], RewardFn]] = {
        "accuracy": lambda: accuracy_reward(grpo.answer_column),
        "format": lambda: format_reward(grpo.format_pattern),
        "overlong": lambda: overlong_reward(grpo.max_completion_length, grpo.overlong_buffer),
    }
    out = []
    for name, weight in zip(grpo.reward_funcs, weights):
        builtin = name in BUILTIN_REWARDS
        fn = made[name]() if builtin else load_user_function(name, base)
        out.append(Reward(name=name if builtin else name.rpartition(":")[2], weight=float(weight), fn=fn))
    return out


def _record_text(
    i: int, prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence[Any]]
) -> str:
    shown = {"prompt": prompts[i], "completion": completions[i]}
    shown.update({k: v[i] for k, v in columns.items() if k not in ("completion_lengths", "truncated")})
    return repr(shown)[:400]


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
) -> List[List[float]]:
    """[reward function][completion] scores; RewardError (one line: the function, what went wrong, the
    record) when a function raises or breaks its contract."""
    out: List[List[float]] = []
    n = len(completions)
    for r in rewards:
        try:
            got = r.fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
        except Exception as exc:
            raise RewardError(
                f"reward function {r.name} raised {type(exc).__name__}: {exc} "
                f"(on the batch starting with {_record_text(0, prompts, completions, columns)})"
            ) from exc
        if not isinstance(got, (list, tuple)) or len(got) != n:
            size = f"{len(got)} values" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            raise RewardError(
                f"reward function {r.name} returned {size} for {n} completions (it must return one float per "
                f"completion; first record: {_record_text(0, prompts, completions, columns)})"
            )
        values = []
        for i, v in enumerate(got):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
                raise RewardError(
                    f"reward function {r.name} returned {v!r} for record {i} "
                    f"{_record_text(i, prompts, completions, columns)}: expected a finite number"
                )
            values.append(float(v))
        out.append(values)
    return out
