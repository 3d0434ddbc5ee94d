"""The GRPO loss and its metrics on one micro-batch, as TRL 1.16's GRPOTrainer._compute_loss defines them
(trl/trainer/grpo_trainer.py; tests/fixtures/make_grpo_parity.py runs TRL's code on fixed inputs and
tests/unit/grpo/test_loss.py compares), and the group-relative advantages.

Inputs are [completions, T] per-token log-probs of the current policy (with gradient), of the policy that
sampled the rollouts (``old``) and of the reference (when beta > 0), the completion mask and one advantage
per completion. With r = exp(logp - old) per token (``token``) or exp(the masked mean of logp - old) per
completion (``sequence``, GSPO):

    per_token_loss = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta (exp(ref - logp) - (ref - logp) - 1)

and the loss averages it over the masked tokens: ``grpo`` per completion, then over completions;
``bnpo`` over all tokens of the micro-batch; ``dr_grpo`` sums and divides by completions x
max_completion_length; ``dapo`` sums and divides by ``num_items`` (the completion tokens of the whole
rollout batch, which the caller passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
import paddle

ADVANTAGE_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


@dataclass(frozen=True)
class LossSettings:
    loss_type: str  # grpo, bnpo, dr_grpo, dapo
    epsilon_low: float
    epsilon_high: float
    beta: float
    importance_sampling_level: str  # token, sequence
    max_completion_length: int

    @classmethod
    def of(cls, grpo: Any) -> LossSettings:
        """From a train_config.grpo section."""
        return cls(
            loss_type=grpo.loss_type,
            epsilon_low=grpo.epsilon,
            epsilon_high=grpo.upper_epsilon,
            beta=grpo.beta,
            importance_sampling_level=grpo.importance_sampling_level,
            max_completion_length=grpo.max_completion_length,
        )


@dataclass(frozen=True)
class LossTerms:
    loss: paddle.Tensor  # scalar
    coef: paddle.Tensor  # the importance ratio: [B, T] (token) or [B, 1] (sequence)
    kl: Optional[paddle.Tensor]  # per-token KL to the reference [B, T] (beta > 0)


def _clamp_min_one(x: paddle.Tensor) -> paddle.Tensor:
    return paddle.clip(x, min=1.0)


def grpo_loss(
    logps: paddle.Tensor,
    old_logps: paddle.Tensor,
    ref_logps: Optional[paddle.Tensor],
    advantages: paddle.Tensor,
    mask: paddle.Tensor,
    s: LossSettings,
    num_items: Optional[float] = None,
) -> LossTerms:
    """The loss of one micro-batch (TRL's value with one accumulation step and one process)."""
    mask = mask.astype(logps.dtype)
    adv = advantages.reshape([-1, 1]).astype(logps.dtype)
    log_ratio = logps - old_logps
    if s.importance_sampling_level == "token":
        log_w = log_ratio
    elif s.importance_sampling_level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / _clamp_min_one(mask.sum(-1))).unsqueeze(-1)
    else:
        raise ValueError(f"unknown importance_sampling_level {s.importance_sampling_level!r}")
    coef = paddle.exp(log_w)
    clipped = paddle.clip(coef, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per_token = -paddle.minimum(coef * adv, clipped * adv)
    kl = None
    if s.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        delta = ref_logps - logps
        kl = paddle.exp(delta) - delta - 1
        per_token = per_token + s.beta * kl
    per_token = per_token * mask  # [B, T] (a [B, 1] loss broadcasts over the tokens here)
    if s.loss_type == "grpo":
        loss = (per_token.sum(-1) / _clamp_min_one(mask.sum(-1))).mean()
    elif s.loss_type == "bnpo":
        loss = per_token.sum() / _clamp_min_one(mask.sum())
    elif s.loss_type == "dr_grpo":
        loss = per_token.sum() / (per_token.shape[0] * s.max_completion_length)
    elif s.loss_type == "dapo":
        items = float(mask.sum()) if num_items is None else num_items
        loss = per_token.sum() / max(items, 1.0)
    else:
        raise ValueError(f"unknown loss_type {s.loss_type!r}")
    return LossTerms(loss=loss, coef=coef, kl=kl)


def _seq_mean(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if x.shape[1] == 1:
        return x[:, 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return (x * mask).sum(-1) / mask.sum(-1)  # nan for an empty completion, as TRL (nanmin skips it)


def _global_mean(x: np.ndarray, mask: np.ndarray) -> float:
    if x.shape[1] == 1:
        return float(x.sum() / max(x.shape[0], 1))
    return float((x * mask).sum() / max(mask.sum(), 1.0))


def _nan_extreme(x: np.ndarray, fn: str) -> float:
    kept = x[~np.isnan(x)]
    return float("nan") if kept.size == 0 else float(getattr(kept, fn)())


def loss_metrics(
    terms: LossTerms,
    advantages: np.ndarray,
    mask: np.ndarray,
    s: LossSettings,
    entropies: Optional[np.ndarray] = None,
) -> Dict[str, float]:
    """TRL's metrics of one micro-batch: kl (beta > 0), entropy, clip_ratio/{low_mean, high_mean,
    region_mean, low_min, high_max}."""
    mask = mask.astype(np.float64)
    coef = terms.coef.numpy().astype(np.float64)
    adv = advantages.reshape(-1, 1)
    out: Dict[str, float] = {}
    if terms.kl is not None:
        out["kl"] = _global_mean(terms.kl.numpy().astype(np.float64), mask)
    if entropies is not None:
        out["entropy"] = _global_mean(entropies.astype(np.float64), mask)
    low = ((coef < 1 - s.epsilon_low) & (adv < 0)).astype(np.float64)
    high = ((coef > 1 + s.epsilon_high) & (adv > 0)).astype(np.float64)
    region = np.maximum(low, high)
    out["clip_ratio/low_mean"] = _global_mean(low, mask)
    out["clip_ratio/high_mean"] = _global_mean(high, mask)
    out["clip_ratio/region_mean"] = _global_mean(region, mask)
    out["clip_ratio/low_min"] = _nan_extreme(_seq_mean(low, mask), "min")
    out["clip_ratio/high_max"] = _nan_extreme(_seq_mean(high, mask), "max")
    return out


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str) -> Dict[str, np.ndarray]:
    """TRL's advantages of a rollout batch's total rewards [N] (groups of ``num_generations`` consecutive
    completions of one prompt): the reward less its group's mean, divided by (std + 1e-4) of the group
    (``group``) or of the whole batch (``batch``), or not divided (``none``); std with Bessel's
    correction. Also the std used (``std``) for frac_reward_zero_std."""
    grouped = rewards.reshape(-1, num_generations).astype(np.float64)
    mean = np.repeat(grouped.mean(1), num_generations)
    std: np.ndarray
    if scale_rewards == "batch":
        std = np.full(rewards.shape, rewards.astype(np.float64).std(ddof=1) if rewards.size > 1 else 0.0)
    elif scale_rewards in ("group", "none"):
        std = np.repeat(grouped.std(1, ddof=1), num_generations)
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    adv = rewards - mean
    if scale_rewards != "none":
        adv = adv / (std + ADVANTAGE_EPS)
    return {"advantages": adv, "std": std}
