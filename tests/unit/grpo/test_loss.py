"""The GRPO loss, its gradient and its metrics against TRL 1.16's GRPOTrainer._compute_loss (numbers
computed by TRL's own code: tests/fixtures/make_grpo_parity.py), and the advantages against TRL's
formula (trl/trainer/grpo_trainer.py, _generate_and_score_completions: reward less the group mean,
divided by nanstd + 1e-4, nanstd with Bessel's correction) written out here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.grpo.loss import LossSettings, group_advantages, grpo_loss, loss_metrics

FIXTURE = json.loads((Path(__file__).parents[2] / "fixtures" / "grpo_parity.json").read_text())
CASES = sorted(FIXTURE["cases"])


def _t(key: str, grad: bool = False) -> paddle.Tensor:
    x = paddle.to_tensor(np.asarray(FIXTURE[key], dtype=np.float64))
    x.stop_gradient = not grad
    return x


def _settings(loss_type: str, level: str, beta: float) -> LossSettings:
    return LossSettings(
        loss_type=loss_type,
        epsilon_low=FIXTURE["epsilon_low"],
        epsilon_high=FIXTURE["epsilon_high"],
        beta=beta,
        importance_sampling_level=level,
        max_completion_length=FIXTURE["max_completion_length"],
    )


@pytest.mark.parametrize("case", CASES)
def test_loss_gradient_and_metrics_equal_trl(case):
    loss_type, level, beta = case.split("/")
    trl = FIXTURE["cases"][case]
    s = _settings(loss_type, level, float(beta))
    logps = _t("logps", grad=True)
    mask = np.asarray(FIXTURE["mask"])
    terms = grpo_loss(
        logps,
        _t("old_logps"),
        _t("ref_logps"),
        _t("advantages"),
        paddle.to_tensor(mask),
        s,
        num_items=FIXTURE["num_items"],
    )
    terms.loss.backward()
    assert float(terms.loss) == pytest.approx(trl["loss"], rel=1e-6, abs=1e-9)
    np.testing.assert_allclose(logps.grad.numpy(), trl["grad"], rtol=1e-6, atol=1e-9)
    got = loss_metrics(terms, np.asarray(FIXTURE["advantages"]), mask, s, np.asarray(FIXTURE["entropies"]))
    assert set(got) == set(trl["metrics"])
    for name, value in trl["metrics"].items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


def test_the_fixture_exercises_clipping_on_both_sides_and_the_kl():
    m = FIXTURE["cases"]["grpo/token/0.04"]["metrics"]
    assert m["clip_ratio/low_mean"] > 0 and m["clip_ratio/high_mean"] > 0 and m["kl"] > 0
    losses = {FIXTURE["cases"][c]["loss"] for c in CASES}
    assert len(losses) == len(CASES)  # every loss_type / level / beta gives its own number


def test_first_update_has_ratio_one_and_the_policy_gradient_form():
    """With old == current (num_iterations 1) the loss is -mean(A) per token and its gradient -A/|o|."""
    logps = paddle.to_tensor(np.log(np.full((2, 3), 0.5)))
    logps.stop_gradient = False
    adv = paddle.to_tensor(np.array([1.0, -2.0]))
    mask = paddle.to_tensor(np.array([[1, 1, 1], [1, 0, 0]]))
    terms = grpo_loss(logps, logps.detach(), None, adv, mask, LossSettings("grpo", 0.2, 0.2, 0.0, "token", 3))
    terms.loss.backward()
    assert float(terms.loss) == pytest.approx(-(1.0 - 2.0) / 2)
    np.testing.assert_allclose(logps.grad.numpy(), [[-1 / 6, -1 / 6, -1 / 6], [1.0, 0, 0]], rtol=1e-12)


def _trl_advantages(rewards, g, scale):
    grouped = rewards.reshape(-1, g)
    mean = np.repeat(grouped.mean(1), g)
    if scale == "batch":
        std = np.full_like(rewards, np.sqrt(((rewards - rewards.mean()) ** 2).sum() / (len(rewards) - 1)))
    else:
        dev = grouped - grouped.mean(1, keepdims=True)
        std = np.repeat(np.sqrt((dev**2).sum(1) / (g - 1)), g)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages(scale):
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.0, 1.5, 1.0])
    got = group_advantages(rewards, 4, scale)
    np.testing.assert_allclose(got["advantages"], _trl_advantages(rewards, 4, scale), rtol=1e-12)
    # a group whose completions all scored the same carries no signal (advantage 0) in every mode
    np.testing.assert_allclose(got["advantages"][4:8], 0.0, atol=1e-12)
    if scale == "group":
        assert got["advantages"][0] == pytest.approx(0.5 / (np.std([1, 0, 0, 1], ddof=1) + 1e-4))
