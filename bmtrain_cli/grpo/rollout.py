"""Rollouts of stage grpo: completions sampled from the current policy with the model's KV-cache
generator (models/generate.py), scored by the reward functions, turned into advantages and cut into the
micro-batches the shared step trains on.

``RolloutSource`` is the run's training "loader": the shared loop (recipes/sft.py loop, train/loop/step.py
MicroBatches) draws ``grad_accum_steps`` micro-batches per optimizer step from it. One rollout batch is a
step's prompts (global_batch_size / num_generations of them) x num_generations completions; it is sampled
when the previous one has served ``num_iterations`` steps, with the old policy's per-token log-probs kept
when num_iterations > 1 (TRL reuses the current ones, detached, otherwise). Its state (the prompt cursor,
the rollouts drawn, the position in the current batch and the batch itself) goes into every checkpoint
(``state_dict``), and each rollout batch's sampling seed is drawn from (train_config.seed, its number), so
a resumed run samples exactly what an uninterrupted one does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.grpo.loss import group_advantages
from bmtrain_cli.grpo.prompts import Prompt, PromptSet
from bmtrain_cli.grpo.rewards import Reward, score
from bmtrain_cli.grpo.shard import DataShard
from bmtrain_cli.models.decoding import SamplingOptions

Batch = Dict[str, np.ndarray]
LogpsFn = Callable[[Batch], np.ndarray]  # per-token log-probs [rows, T] of a batch, without gradient


def rollout_seed(seed: int, number: int) -> int:
    """The sampling seed of rollout batch ``number`` of a run seeded ``seed``."""
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


def columns_of(prompts: Sequence[Prompt]) -> Dict[str, List[Any]]:
    """The prompt records' other fields as columns (None where a record lacks one)."""
    names = sorted({k for p in prompts for k in p.columns})
    return {k: [p.columns.get(k) for p in prompts] for k in names}


def pack(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> Batch:
    """Right-padded rows of prompt + completion with each completion's start, ids and mask [rows, T]."""
    rows = len(prompt_ids)
    width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
    t = max(1, max(len(c) for c in completion_ids))
    ids = np.zeros((rows, width), dtype=np.int64)
    seg = np.zeros((rows, width), dtype=np.int64)
    comp = np.zeros((rows, t), dtype=np.int64)
    mask = np.zeros((rows, t), dtype=np.int64)
    start = np.zeros(rows, dtype=np.int64)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        seq = list(p) + list(c)
        ids[i, : len(seq)] = seq
        seg[i, : len(seq)] = 1
        comp[i, : len(c)] = c
        mask[i, : len(c)] = 1
        start[i] = len(p)
    pos = np.tile(np.arange(width, dtype=np.int64), (rows, 1))
    return {
        "input_ids": ids,
        "attention_mask": seg,
        "position_ids": pos,
        "completion_start": start,
        "completion_ids": comp,
        "completion_mask": mask,
    }


@dataclass(frozen=True)
class Sampling:
    """A rollout batch's sampling: ``num_generations`` completions per prompt, each decoded as
    ``decoding`` says (max_completion_length as its max_new_tokens; its seed is replaced per generate
    call), and how truncated completions and rewards count."""

    num_generations: int
    mask_truncated_completions: bool
    scale_rewards: str
    decoding: SamplingOptions

    @property
    def eos_id(self) -> Optional[int]:
        return self.decoding.eos_token_id


def sample_completions(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    s: Sampling,
    seed: int,
    rows_per_call: int,
    first_call: int = 0,
) -> List[List[int]]:
    """Completions of each prompt row (EOS included when sampled), ``rows_per_call`` rows per batched
    generate() call, call k with its own seed drawn from (``seed``, ``first_call`` + k): a data rank's
    block of a rollout batch samples what one process does with the same rows."""
    from bmtrain_cli.models.generate import generate

    out: List[List[int]] = []
    for k, start in enumerate(range(0, len(prompt_ids), rows_per_call), start=first_call):
        chunk = prompt_ids[start : start + rows_per_call]
        out.extend(generate(model, chunk, replace(s.decoding, seed=rollout_seed(seed, k))))
    return out


def decode_completion(tokenizer: Any, ids: Sequence[int], eos_id: Optional[int]) -> str:
    return tokenizer.decode(list(ids[:-1]) if eos_id is not None and ids and ids[-1] == eos_id else list(ids))


def reward_metrics(
    rewards: Sequence[Reward], per_func: np.ndarray, total: np.ndarray, std: np.ndarray
) -> Dict[str, float]:
    """TRL's reward figures of a rollout batch: reward, reward_std, rewards/<name>/{mean,std},
    frac_reward_zero_std."""
    ddof = 1 if total.size > 1 else 0
    out = {"reward": float(total.mean()), "reward_std": float(total.std(ddof=ddof))}
    for r, values in zip(rewards, per_func):
        out[f"rewards/{r.name}/mean"] = float(values.mean())
        out[f"rewards/{r.name}/std"] = float(values.std(ddof=ddof))
    out["frac_reward_zero_std"] = float(np.isclose(std, 0.0).mean())
    return out


def score_completions(
    rewards: Sequence[Reward],
    prompts: Sequence[Prompt],
    completions: Sequence[List[int]],
    texts: Sequence[str],
    s: Sampling,
) -> Tuple[np.ndarray, np.ndarray, Dict[str, List[Any]]]:
    """(per-function rewards [F, N], weighted total [N], the columns the functions were given)."""
    columns = columns_of(prompts)
    columns["completion_lengths"] = [len(c) for c in completions]
    columns["truncated"] = [is_truncated(c, s) for c in completions]
    per_func = np.asarray(score(rewards, [p.value for p in prompts], texts, columns), dtype=np.float64)
    weights = np.asarray([r.weight for r in rewards], dtype=np.float64)
    return per_func, (per_func * weights[:, None]).sum(0), columns


def is_truncated(completion: Sequence[int], s: Sampling) -> bool:
    """Cut at max_completion_length without its end-of-sequence token."""
    return s.eos_id is None or not completion or completion[-1] != s.eos_id


class RolloutSource:
    """The micro-batches of a GRPO run, sampled from the policy as the steps ask (see the module doc)."""

    def __init__(
        self,
        prompts: PromptSet,
        *,
        tokenizer: Any,
        rewards: Sequence[Reward],
        sampling: Sampling,
        micro_batch_size: int,
        micro_per_step: int,
        num_iterations: int,
        seed: int,
        shuffle: bool,
        shard: DataShard = DataShard(),
    ) -> None:
        self.dataset = prompts
        self.sampling = sampling
        self.micro_batch_size = micro_batch_size  # completions
        self.micro_per_step = micro_per_step
        self.num_iterations = num_iterations
        self.seed = seed
        self.shuffle = shuffle
        self.shard = shard
        # a step's prompts over all data ranks; each rank trains on its block of their completions
        self.prompts_per_step = micro_batch_size * micro_per_step * shard.world // sampling.num_generations
        self.longest = max(len(p.ids) for p in prompts.prompts) + sampling.decoding.max_new_tokens
        self.cursor = 0  # prompts drawn so far (epoch = cursor // len(prompts))
        self.rollouts = 0  # rollout batches sampled so far
        self.served = 0  # micro-batches of the current rollout batch handed out
        self.buffer: Optional[Dict[str, Any]] = None
        self.metrics: Dict[str, float] = {}  # of the current rollout batch
        self.rollout_time = 0.0  # seconds spent sampling and scoring since last read
        self.tokenizer = tokenizer
        self.reward_functions = rewards
        self._policy: Optional[Any] = None
        self._old: Optional[LogpsFn] = None
        self._ref: Optional[LogpsFn] = None

    def attach(self, policy: Any, old: Optional[LogpsFn], ref: Optional[LogpsFn]) -> None:
        """What sampling needs once the model exists: the policy and the log-probs kept with a batch (old
        policy: num_iterations > 1; reference: beta > 0)."""
        self._policy, self._old, self._ref = policy, old, ref

    def stats(self) -> Dict[str, Any]:
        return self.dataset.stats()

    def start_rejected_log(self, output_dir: Any, is_main: bool) -> None:
        self.dataset.start_rejected_log(output_dir, is_main)

    def __len__(self) -> int:
        """Micro-batches per epoch of the prompts (each rollout batch serves num_iterations steps)."""
        steps = -(-len(self.dataset) // self.prompts_per_step)
        return steps * self.num_iterations * self.micro_per_step

    def __iter__(self) -> RolloutSource:
        return self

    def __next__(self) -> Batch:
        per_batch = self.micro_per_step * self.num_iterations
        if self.buffer is None or self.served >= per_batch:
            self.buffer = self._sample()
            self.served = 0
        i = self.served % self.micro_per_step
        self.served += 1
        start = (self.shard.rank * self.micro_per_step + i) * self.micro_batch_size
        rows = slice(start, start + self.micro_batch_size)
        return {k: v[rows] for k, v in self.buffer["arrays"].items()}

    def _next_prompts(self) -> List[Prompt]:
        n = len(self.dataset)
        out = []
        for k in range(self.cursor, self.cursor + self.prompts_per_step):
            epoch, pos = divmod(k, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            out.append(self.dataset.prompts[int(order[pos])])
        self.cursor += self.prompts_per_step
        return out

    def _sample(self) -> Dict[str, Any]:
        """The next rollout batch, whole on every rank: this rank samples and scores its block of rows,
        the rest comes from the other data ranks (grpo/shard.py)."""
        assert self._policy is not None, "RolloutSource.attach() first"
        started = time.perf_counter()
        s, g, m = self.sampling, self.sampling.num_generations, self.micro_batch_size
        prompts = [p for p in self._next_prompts() for _ in range(g)]  # each prompt's group, consecutive
        mine = self.shard.block(len(prompts))
        local = sample_completions(
            self._policy,
            [p.ids for p in prompts[mine]],
            s,
            rollout_seed(self.seed, self.rollouts),
            m,
            first_call=mine.start // m,
        )
        self.rollouts += 1
        texts = [decode_completion(self.tokenizer, c, s.eos_id) for c in local]
        per_func, total, _ = score_completions(self.reward_functions, prompts[mine], local, texts, s)
        scores = self.shard.gather(np.vstack([per_func, total[None]]).T).T
        per_func, total = scores[:-1], scores[-1]
        completions = self.shard.gather_lists(local)
        adv = group_advantages(total, g, s.scale_rewards)
        arrays = pack([p.ids for p in prompts], completions)
        truncated = np.asarray([is_truncated(c, s) for c in completions], dtype=bool)
        if s.mask_truncated_completions:
            arrays["completion_mask"] *= ~truncated[:, None]
        arrays["advantages"] = adv["advantages"].astype(np.float32)
        for key, fn in (("old_logps", self._old), ("ref_logps", self._ref)):
            if fn is not None:
                arrays[key] = self.shard.gather(
                    np.concatenate(
                        [
                            fn({k: v[i : i + m] for k, v in arrays.items()})
                            for i in range(mine.start, mine.stop, m)
                        ]
                    )
                )
        lengths = np.asarray([len(c) for c in completions], dtype=np.float64)
        self.metrics = {
            **reward_metrics(self.reward_functions, per_func, total, adv["std"]),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.astype(np.float64).mean()),
        }
        self.rollout_time += time.perf_counter() - started
        return {"arrays": arrays, "metrics": self.metrics}

    def take_rollout_time(self) -> float:
        """Seconds spent on rollouts since the last call."""
        spent, self.rollout_time = self.rollout_time, 0.0
        return spent

    # ------------------------------------------------------------------ checkpoint (trainer_state.json)

    def state_dict(self) -> Dict[str, Any]:
        buffer = None
        if self.buffer is not None:
            buffer = {
                "arrays": {
                    k: {"dtype": str(v.dtype), "data": v.tolist()} for k, v in self.buffer["arrays"].items()
                },
                "metrics": self.buffer["metrics"],
            }
        return {"cursor": self.cursor, "rollouts": self.rollouts, "served": self.served, "buffer": buffer}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.cursor = int(state["cursor"])
        self.rollouts = int(state["rollouts"])
        self.served = int(state["served"])
        saved = state.get("buffer")
        self.buffer = None
        if saved is not None:
            arrays = {k: np.asarray(v["data"], dtype=v["dtype"]) for k, v in saved["arrays"].items()}
            self.buffer = {"arrays": arrays, "metrics": dict(saved["metrics"])}
            self.metrics = dict(saved["metrics"])
