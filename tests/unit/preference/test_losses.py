"""The preference losses against TRL (numbers computed by TRL's own code: tests/fixtures/
make_preference_parity.py) and against the papers' formulas written out in numpy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.preference.losses import PairLogps, log1mexp, pair_terms

FIXTURE = json.loads((Path(__file__).parents[2] / "fixtures" / "preference_parity.json").read_text())
P = len(FIXTURE["lengths"]) // 2


def _inputs(fx: dict = FIXTURE):
    seq = np.asarray(fx["sequence_logps"])
    ref = np.asarray(fx["ref_logps"])
    n = np.asarray(fx["lengths"], dtype=np.float64)
    t = lambda a: paddle.to_tensor(a.astype(np.float64))  # noqa: E731
    return [t(seq[:P]), t(seq[P:]), t(ref[:P]), t(ref[P:]), t(n[:P]), t(n[P:])]


def _terms(kind: str, **kw):
    defaults = {"beta": FIXTURE["beta"], "simpo_gamma": FIXTURE["simpo_gamma"]}
    return pair_terms(kind, PairLogps(*_inputs()), **{**defaults, **kw})


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
def test_dpo_and_ipo_equal_trl_dpo_trainer(kind):
    trl = FIXTURE[kind]
    terms = _terms(kind)
    c, r = terms.chosen_rewards.numpy(), terms.rejected_rewards.numpy()
    assert float(terms.loss.mean()) == pytest.approx(trl["loss"], rel=1e-6)
    assert c.mean() == pytest.approx(trl["rewards/chosen"], rel=1e-6)
    assert r.mean() == pytest.approx(trl["rewards/rejected"], rel=1e-6)
    assert (c - r).mean() == pytest.approx(trl["rewards/margins"], rel=1e-6)
    assert (c > r).mean() == pytest.approx(trl["rewards/accuracies"], rel=1e-6)
    assert terms.chosen_logps.numpy().mean() == pytest.approx(trl["logps/chosen"], rel=1e-6)
    assert terms.rejected_logps.numpy().mean() == pytest.approx(trl["logps/rejected"], rel=1e-6)


def test_label_smoothed_dpo_simpo_and_orpo_equal_trl():
    smooth = FIXTURE["label_smoothing"]
    np.testing.assert_allclose(
        _terms("sigmoid", label_smoothing=smooth).loss.numpy(), FIXTURE["sigmoid_smoothed_losses"], rtol=1e-6
    )
    simpo = _terms("simpo", label_smoothing=smooth)
    np.testing.assert_allclose(simpo.loss.numpy(), FIXTURE["simpo_losses"], rtol=1e-6)
    np.testing.assert_allclose(simpo.chosen_rewards.numpy(), FIXTURE["simpo_chosen_rewards"], rtol=1e-6)
    # TRL returns beta * log sigmoid(log odds) and subtracts its mean; ours is the per-pair loss term
    np.testing.assert_allclose(_terms("orpo").loss.numpy(), -np.asarray(FIXTURE["orpo_losses"]), rtol=1e-6)


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def test_losses_equal_the_papers_formulas_in_numpy():
    rng = np.random.default_rng(3)
    beta, gamma, eps = 0.2, 0.4, 0.1
    pc, pr, rc, rr = (-rng.gamma(3.0, 2.0, 8) for _ in range(4))
    nc, nr = rng.integers(1, 20, 8).astype(np.float64), rng.integers(1, 20, 8).astype(np.float64)
    args = [paddle.to_tensor(a) for a in (pc, pr, rc, rr, nc, nr)]
    h = beta * ((pc - rc) - (pr - rr))  # DPO eq. 7, cDPO smoothing
    dpo = -(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)
    ipo = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2  # IPO eq. 17, per token
    simpo = -_log_sigmoid(beta * pc / nc - beta * pr / nr - gamma)  # SimPO eq. 6
    ac, ar = pc / nc, pr / nr  # ORPO eqs. 4-7: odds = p / (1 - p) of the mean token log-prob
    orpo = -beta * _log_sigmoid(np.log(np.exp(ac) / (1 - np.exp(ac))) - np.log(np.exp(ar) / (1 - np.exp(ar))))
    got = {
        "sigmoid": pair_terms("sigmoid", PairLogps(*args), beta=beta, label_smoothing=eps).loss.numpy(),
        "ipo": pair_terms("ipo", PairLogps(*args), beta=beta).loss.numpy(),
        "simpo": pair_terms("simpo", PairLogps(*args), beta=beta, simpo_gamma=gamma).loss.numpy(),
        "orpo": pair_terms("orpo", PairLogps(*args), beta=beta).loss.numpy(),
    }
    for kind, want in {"sigmoid": dpo, "ipo": ipo, "simpo": simpo, "orpo": orpo}.items():
        np.testing.assert_allclose(got[kind], want, rtol=1e-9, err_msg=kind)


def test_reference_free_losses_ignore_the_reference():
    a = _inputs()
    moved = [a[0], a[1], a[2] + 5.0, a[3] - 3.0, a[4], a[5]]
    for kind in ("simpo", "orpo"):
        same = pair_terms(kind, PairLogps(*moved), beta=0.3).loss.numpy()
        np.testing.assert_array_equal(pair_terms(kind, PairLogps(*a), beta=0.3).loss.numpy(), same)
    assert not np.allclose(
        pair_terms("sigmoid", PairLogps(*moved), beta=0.3).loss.numpy(), _terms("sigmoid").loss.numpy()
    )


def test_log1mexp_is_stable_at_both_ends():
    x = np.array([-1e-9, -1e-4, -0.5, -0.7, -1.0, -30.0, -200.0])
    got = log1mexp(paddle.to_tensor(x)).numpy()
    # each end in its well-conditioned form: log(-expm1(x)) near 0, log1p(-exp(x)) far below
    want = np.where(x > -0.6, np.log(-np.expm1(np.minimum(x, -1e-300))), np.log1p(-np.exp(x)))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[-1] < 0  # log(1 - e^-200) = -e^-200, not 0
    assert np.isfinite(got).all()


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown preference loss"):
        _terms("hinge")
