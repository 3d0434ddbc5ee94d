"""The GRPO objective as the shared step calls it (train/parts.py Objective): the per-token log-probs of
the completions in a micro-batch, the loss of grpo/loss.py weighted so that a step equals TRL's over its
accumulation steps, the step's metrics, and the held-out reward as the evaluation.

Per optimizer step TRL averages its micro-batch losses over the accumulation steps, and ``dapo`` divides
the rollout batch's summed token losses by its completion tokens. Here each micro-batch's summed loss is
divided by one denominator for the whole step: ``dapo`` sums token losses over the completion tokens of
the step; the others give (their micro-batch loss x its completions) over the step's completions, which is
TRL's mean of equal-sized micro-batches.

A mixture of experts with output_router_logits adds ``router_aux_loss_coef x`` the load-balancing loss of
each micro-batch's policy forward (models/decoder.py ``aux_loss``), over the tokens TRL's attention mask
keeps (:func:`routed_mask`), as TRL adds ``coef x aux / accumulation steps`` to each micro-batch's loss: its
weight here is the step's denominator over the step's micro-batches, so the step's loss holds the mean of
``coef x aux`` over its micro-batches (all data ranks).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import paddle

from bmtrain_cli.grpo.loss import LossSettings, grpo_loss, loss_metrics
from bmtrain_cli.grpo.prompts import PromptSet
from bmtrain_cli.grpo.rollout import (
    RolloutSource,
    Sampling,
    decode_completion,
    sample_completions,
    score_completions,
)
from bmtrain_cli.methods import GRPO_EVAL_ROWS
from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.preference.logps import graph_zero, model_inputs, share_inputs, token_logps
from bmtrain_cli.preference.reference import adapters_disabled

Batch = Dict[str, np.ndarray]


def completion_logps(
    model: Any, batch: Batch, temperature: float, with_entropy: bool = False
) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
    """(log p(completion token) [rows, T] under ``model`` with logits / temperature, as TRL scores them;
    the entropy of each of those predictions, or None). Only the positions that predict a completion
    token go through the LM head. A context-parallel share (parallel/ring_attention.split_batch) runs the
    ring over its columns and scores the predictions it holds; both are then summed over the context group
    (each position is held by one rank), so every rank of the group returns the whole rows'."""
    rows, t = batch["completion_ids"].shape
    cols = batch["completion_start"][:, None] - 1 + np.arange(t)[None, :]
    cols = np.where(batch["completion_mask"] > 0, cols, batch["completion_start"][:, None] - 1)
    share = "context_columns" in batch
    hidden = model.hidden_states(**(share_inputs(model, batch) if share else model_inputs(batch)))
    held, local = held_columns(batch["context_columns"], cols) if share else (np.ones(cols.shape, bool), cols)
    logps, entropy = _scored(model, hidden, batch, held, local, temperature, with_entropy)
    if not share:
        assert logps is not None  # one process predicts every completion token
        return logps.reshape([rows, t]), None if entropy is None else entropy.reshape([rows, t])
    return _summed_over_group(model, hidden, held, logps, entropy, with_entropy)


def _scored(
    model: Any,
    hidden: paddle.Tensor,
    batch: Batch,
    held: np.ndarray,
    local: np.ndarray,
    temperature: float,
    with_entropy: bool,
) -> Tuple[Optional[paddle.Tensor], Optional[paddle.Tensor]]:
    """(log-probs, entropies or None) of the ``held`` predictions in row order, from the hidden states at
    their ``local`` columns; (None, None) when none is held."""
    if not held.any():
        return None, None
    rows, width = held.shape[0], batch["input_ids"].shape[1]
    flat = paddle.to_tensor((np.arange(rows)[:, None] * width + local)[held].astype(np.int64))
    picked = paddle.gather(hidden.reshape([rows * width, -1]), flat)
    logits = model.logits_from_hidden(picked).astype("float32") / temperature
    targets = paddle.to_tensor(batch["completion_ids"][held].astype(np.int64))
    logps = token_logps(logits, targets, getattr(model, "factory", None))
    return logps, token_entropy(logits, model.factory) if with_entropy else None


def held_columns(columns: np.ndarray, cols: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(which of the row positions ``cols`` a context-parallel share holds, their index in the share)."""
    local = np.full(max(int(cols.max()), int(columns.max())) + 1, -1, dtype=np.int64)
    local[columns] = np.arange(len(columns))
    at = local[cols]
    return at >= 0, np.maximum(at, 0)


def _summed_over_group(
    model: Any,
    hidden: paddle.Tensor,
    held: np.ndarray,
    logps: Optional[paddle.Tensor],
    entropy: Optional[paddle.Tensor],
    with_entropy: bool,
) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
    """The held values put at their [rows, T] places (zeros elsewhere) and summed over the context group:
    the log-probs through ContextSum (its gradient reaches each rank's own predictions), the entropy plainly.
    On a rank that holds no prediction a zero through the LM head (preference/logps.graph_zero) keeps the
    graph, so that every rank runs the sum's backward."""
    from bmtrain_cli.parallel.ring_attention import ContextSum

    ring = model.context_attention.ring
    n = int(held.sum())
    slot = np.full(held.size, n, dtype=np.int64)
    slot[held.reshape(-1)] = np.arange(n)
    slot_t = paddle.to_tensor(slot)
    if logps is None:
        padded = graph_zero(model, hidden).astype("float32")
    else:
        padded = paddle.concat([logps, paddle.zeros([1], logps.dtype)])
    whole = paddle.gather(padded, slot_t)
    out = ContextSum.apply(whole.reshape(list(held.shape)), ring)
    if not with_entropy:
        return out, None
    with paddle.no_grad():
        ent = paddle.zeros([1]) if entropy is None else paddle.concat([entropy, paddle.zeros([1])])
        return out, ring.all_reduce(paddle.gather(ent, slot_t).reshape(list(held.shape)))


def routed_mask(batch: Batch) -> np.ndarray:
    """[rows, width] 1/0: the tokens the load-balancing loss counts, those of TRL's attention mask of the
    policy forward (the prompt and the completion tokens ``completion_mask`` keeps: a truncated completion
    that mask_truncated_completions drops is left out; padding never); a context-parallel share's columns
    of it (``context_columns``)."""
    att = batch["attention_mask"]
    t = batch["completion_mask"].shape[1]
    rel = np.arange(att.shape[1])[None, :] - batch["completion_start"][:, None]
    kept = np.take_along_axis(batch["completion_mask"], np.clip(rel, 0, t - 1), axis=1)
    mask = (np.where(rel >= 0, kept, 1) * (att > 0)).astype(np.int64)
    if "context_columns" not in batch:
        return mask
    cols = batch["context_columns"]
    return np.pad(mask, ((0, 0), (0, max(0, int(cols.max()) + 1 - mask.shape[1]))))[:, cols]


@paddle.no_grad()
def token_entropy(logits: paddle.Tensor, factory: Any) -> paddle.Tensor:
    """The entropy of softmax(``logits``) per row [tokens, vocab] (a vocabulary shard under tensor
    parallel, the max and the sums then combined over the group): log S - sum p (z - m), where m is the
    row's max logit, S = sum exp(z - m) and p = exp(z - m) / S."""
    shifted = logits - factory.vocab_reduce(logits.max(-1, keepdim=True), "max")
    exp = paddle.exp(shifted)
    total = factory.vocab_reduce(exp.sum(-1, keepdim=True), "sum")
    weighted = factory.vocab_reduce((exp * shifted).sum(-1, keepdim=True), "sum")
    return (paddle.log(total) - weighted / total).reshape([-1])


def no_grad_logps(
    model: Any, temperature: float, adapters_off: bool = False
) -> Callable[[Batch], np.ndarray]:
    """Per-token completion log-probs of ``model`` without gradient, in eval mode: the old policy (the
    current weights when the rollout is sampled) or the reference (a frozen copy, or the policy with its
    LoRA adapters off). A model with a context group (collective) scores its share of the rows as the
    training step does, so that the policy and these log-probs round alike."""

    def logps(batch: Batch) -> np.ndarray:
        core = getattr(model, "context_attention", None)
        if core is not None:
            from bmtrain_cli.parallel.ring_attention import split_batch

            batch = split_batch(batch, core.ring.degree, core.ring.rank)
        was_training = model.training
        model.eval()
        try:
            with paddle.no_grad(), adapters_disabled(model) if adapters_off else contextlib.nullcontext():
                return completion_logps(model, batch, temperature)[0].numpy().astype(np.float32)
        finally:
            model.train(was_training)

    return logps


class GrpoObjective:
    """train/parts.py Objective of stage grpo."""

    perplexity = False  # the eval loss is minus the held-out mean reward, not a token NLL

    def __init__(
        self,
        settings: LossSettings,
        temperature: float,
        source: RolloutSource,
        eval_prompts: Optional[PromptSet],
        eval_limit: int,
    ) -> None:
        self.settings = settings
        self.temperature = temperature
        self.source = source
        self.eval_prompts = eval_prompts
        self.eval_limit = eval_limit
        self.shard = source.shard  # the data ranks the step's counts and figures are summed over
        self._micro: List[Dict[str, float]] = []
        self._step_started = 0.0
        self._aux_weight = 0.0  # the step's denominator over its micro-batches (all data ranks)

    # ------------------------------------------------------------------ the step

    def begin_step(self, micro: List[Batch]) -> Tuple[float, float]:
        self._micro = []
        self._step_started = time.perf_counter()
        tokens = float(sum(int(b["attention_mask"].sum()) for b in micro))
        if self.settings.loss_type == "dapo":
            count = float(sum(int(b["completion_mask"].sum()) for b in micro))
        else:
            count = float(sum(len(b["advantages"]) for b in micro))
        count, tokens, batches = self.shard.sum(np.asarray([count, tokens, float(len(micro))]))
        self._aux_weight = float(count) / max(float(batches), 1.0)
        return float(count), float(tokens)

    def loss_sum(self, model: Any, batch: Batch) -> Tuple[Any, Any]:
        logps, entropy = completion_logps(model, batch, self.temperature, with_entropy=True)
        # MoE with output_router_logits (else None): the whole micro-batch's, also on a context share
        aux = model.aux_loss(paddle.to_tensor(routed_mask(batch)), over_context="context_columns" in batch)
        old = paddle.to_tensor(batch["old_logps"]) if "old_logps" in batch else logps.detach()
        ref = paddle.to_tensor(batch["ref_logps"]) if "ref_logps" in batch else None
        mask = paddle.to_tensor(batch["completion_mask"])
        adv = paddle.to_tensor(batch["advantages"])
        s = self.settings
        terms = grpo_loss(logps, old, ref, adv, mask, s, num_items=1.0)  # dapo: the token sum
        rows = len(batch["advantages"])
        loss = terms.loss if s.loss_type == "dapo" else terms.loss * rows
        if aux is not None:  # TRL: + coef x aux / accumulation steps, per micro-batch
            loss = loss + model.arch.router_aux_loss_coef * aux * self._aux_weight
        if not batch.get("context_lead", True):  # counted by the group's first rank (see ContextSum)
            loss = loss * 0.0
        entropies = entropy.numpy() if entropy is not None else None
        self._micro.append(loss_metrics(terms, batch["advantages"], batch["completion_mask"], s, entropies))
        return loss, paddle.to_tensor(float(rows))

    def step_metrics(self) -> Dict[str, float]:
        """TRL's names: the rollout batch's reward figures and completion lengths, the mean of kl,
        entropy and clip_ratio/* over the step's micro-batches on all data ranks (those that have a
        value), and this rank's seconds spent on rollouts and on the update."""
        out: Dict[str, float] = dict(self.source.metrics)
        names = list(self._micro[0]) if self._micro else []
        values = np.asarray([[m[name] for name in names] for m in self._micro], dtype=np.float64)
        kept = ~np.isnan(values)
        sums = self.shard.sum(np.concatenate([np.where(kept, values, 0.0).sum(0), kept.sum(0)]))
        for k, name in enumerate(names):
            count = sums[len(names) + k]
            out[name] = float(sums[k] / count) if count else float("nan")
        out["time/rollout"] = self.source.take_rollout_time()
        out["time/update"] = time.perf_counter() - self._step_started
        return out

    def pipeline(self, ctx: Any, micro_batch_size: int) -> None:
        return None  # validate-config refuses pipeline parallel for stage grpo

    # ------------------------------------------------------------------ evaluation

    def held_out_reward(self, model: Any, tokenizer: Any) -> Dict[str, float]:
        """Greedy completions of the first eval_prompts held-out prompts, scored: reward and
        rewards/<name>/mean."""
        assert self.eval_prompts is not None, "held-out prompts (eval_data_path) first"
        prompts = self.eval_prompts.prompts[: self.eval_limit]
        s = self.source.sampling
        greedy = Sampling(
            num_generations=1,
            mask_truncated_completions=False,
            scale_rewards="none",
            decoding=SamplingOptions(max_new_tokens=s.decoding.max_new_tokens, eos_token_id=s.eos_id),
        )
        completions = sample_completions(model, [p.ids for p in prompts], greedy, 0, GRPO_EVAL_ROWS)
        texts = [decode_completion(tokenizer, c, s.eos_id) for c in completions]
        per_func, total, _ = score_completions(
            self.source.reward_functions, prompts, completions, texts, greedy
        )
        out = {"reward": float(total.mean())}
        for r, values in zip(self.source.reward_functions, per_func):
            out[f"rewards/{r.name}/mean"] = float(values.mean())
        return out

    def evaluate(self, parts: Any, state: Any) -> Tuple[float, Dict[str, Any]]:
        """Minus the held-out mean reward (so the best eval loss is the best reward), with the rewards."""
        figures = self.held_out_reward(parts.model.raw, parts.tokenizer)
        state.history["eval_rewards"] = figures
        return -figures["reward"], figures
