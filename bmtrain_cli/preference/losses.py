"""Preference losses as pure functions of sequence log-probs (TRL's formulas; docs/preference.md).

Inputs are per pair: the policy's summed log-probs of the chosen and rejected responses, the reference's
(ignored by the reference-free losses), and the number of response tokens of each. Every function returns
``PairTerms``: the per-pair loss, the rewards TRL logs, and the log-probs TRL logs (summed for sigmoid/ipo,
averaged per token for simpo/orpo, as TRL's DPOTrainer and CPOTrainer/ORPOTrainer log them).

ORPO's full loss is ``nll - mean(loss_terms)``-shaped in TRL; here ``loss`` holds ``-beta * log_sigmoid(
log_odds)`` per pair and the caller adds the token-weighted NLL of the chosen responses (objective.py), so
that the NLL stays token-weighted over the whole optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import paddle
import paddle.nn.functional as F

LOSSES = ("sigmoid", "ipo", "simpo", "orpo")


@dataclass
class PairLogps:
    """The inputs of a preference loss, each [pairs]: summed response log-probs of the policy and the
    reference (unused by the reference-free losses) and the response token counts."""

    chosen: paddle.Tensor
    rejected: paddle.Tensor
    ref_chosen: paddle.Tensor
    ref_rejected: paddle.Tensor
    chosen_tokens: paddle.Tensor
    rejected_tokens: paddle.Tensor

    def ratios(self) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """Policy-over-reference log-ratios (chosen, rejected)."""
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def per_token(
        self, chosen: paddle.Tensor, rejected: paddle.Tensor
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """``chosen`` and ``rejected`` (summed over the response) divided by the response token counts."""
        return chosen / paddle.clip(self.chosen_tokens, min=1.0), rejected / paddle.clip(
            self.rejected_tokens, min=1.0
        )


@dataclass
class PairTerms:
    loss: paddle.Tensor  # [pairs]
    chosen_rewards: paddle.Tensor  # [pairs]
    rejected_rewards: paddle.Tensor
    chosen_logps: paddle.Tensor  # what TRL logs as logps/chosen
    rejected_logps: paddle.Tensor


def _smoothed_sigmoid(x: paddle.Tensor, label_smoothing: float) -> paddle.Tensor:
    """-(1 - eps) log sigmoid(x) - eps log sigmoid(-x): conservative DPO (eps = 0: plain DPO)."""
    loss = -F.log_sigmoid(x) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - F.log_sigmoid(-x) * label_smoothing
    return loss


def log1mexp(x: paddle.Tensor) -> paddle.Tensor:
    """log(1 - exp(x)) for x < 0, stable at both ends (Maechler's switch at -log 2)."""
    near = paddle.log(-paddle.expm1(paddle.clip(x, max=-1e-12)))
    far = paddle.log1p(-paddle.exp(x))
    return paddle.where(x > -math.log(2.0), near, far)


def sigmoid_loss(p: PairLogps, beta: float, label_smoothing: float = 0.0) -> PairTerms:
    """DPO (Rafailov et al. 2023, eq. 7), with cDPO label smoothing."""
    chosen_ratio, rejected_ratio = p.ratios()
    loss = _smoothed_sigmoid(beta * (chosen_ratio - rejected_ratio), label_smoothing)
    return PairTerms(loss, beta * chosen_ratio, beta * rejected_ratio, p.chosen, p.rejected)


def ipo_loss(p: PairLogps, beta: float) -> PairTerms:
    """IPO (Azar et al. 2023, eq. 17) on per-token log-ratios, as TRL: (delta - 1 / (2 beta))^2."""
    chosen_ratio, rejected_ratio = p.ratios()
    chosen_avg, rejected_avg = p.per_token(chosen_ratio, rejected_ratio)
    loss = (chosen_avg - rejected_avg - 1.0 / (2.0 * beta)) ** 2
    return PairTerms(loss, beta * chosen_ratio, beta * rejected_ratio, p.chosen, p.rejected)


def simpo_loss(p: PairLogps, beta: float, gamma: float, label_smoothing: float = 0.0) -> PairTerms:
    """SimPO (Meng et al. 2024, eq. 6): reference-free, length-normalised, target margin gamma."""
    avg_c, avg_r = p.per_token(p.chosen, p.rejected)
    loss = _smoothed_sigmoid(beta * (avg_c - avg_r - gamma / beta), label_smoothing)
    return PairTerms(loss, beta * avg_c, beta * avg_r, avg_c, avg_r)


def orpo_odds_loss(p: PairLogps, beta: float) -> PairTerms:
    """ORPO's odds-ratio term (Hong et al. 2024, eqs. 4-7) per pair: -beta * log sigmoid(log odds ratio);
    the NLL term is added by the caller."""
    avg_c, avg_r = p.per_token(p.chosen, p.rejected)
    log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
    loss = -beta * F.log_sigmoid(log_odds)
    return PairTerms(loss, beta * avg_c, beta * avg_r, avg_c, avg_r)


def pair_terms(
    kind: str, p: PairLogps, *, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.5
) -> PairTerms:
    """The loss named by ``train_config.dpo_loss``; the reference log-probs are unused by simpo/orpo."""
    if kind == "sigmoid":
        return sigmoid_loss(p, beta, label_smoothing)
    if kind == "ipo":
        return ipo_loss(p, beta)
    if kind == "simpo":
        return simpo_loss(p, beta, simpo_gamma, label_smoothing)
    if kind == "orpo":
        return orpo_odds_loss(p, beta)
    raise ValueError(f"unknown preference loss {kind!r}; choose one of {', '.join(LOSSES)}")
