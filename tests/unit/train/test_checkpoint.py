"""Checkpoint I/O: exact optimizer/RNG round trip, atomic replace, pruning, write failures."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import TrainConfig
from bmtrain_cli.train import checkpoint as ck
from bmtrain_cli.train.optim import build_optimizer


def _model(seed=0):
    paddle.seed(seed)
    return paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.LayerNorm(8), paddle.nn.Linear(8, 3))


def _steps(model, opt, n, seed):
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(n):
        x = paddle.to_tensor(rng.standard_normal((4, 6)).astype("float32"))
        loss = (model(x) ** 2).mean() + paddle.rand([1]).sum() * 0  # touch the Paddle RNG
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    return losses


def _save(root, step, model, opt, **kw):
    return ck.save_checkpoint(root, step, model=model, optimizer=opt, state={"note": "x"}, **kw)


def test_resume_is_exact(tmp_path):
    cfg = TrainConfig(learning_rate=0.05, weight_decay=0.1)
    m = _model()
    opt = build_optimizer(m, cfg, 0.05)
    _steps(m, opt, 3, seed=1)
    path = _save(tmp_path / "ckpt", 3, m, opt)
    ref = _steps(m, opt, 3, seed=2)
    # a fresh process would build a new model (different internal parameter names)
    _model(seed=5)
    m2 = _model(seed=7)
    opt2 = build_optimizer(m2, cfg, 0.05)
    ck.load_native_weights(m2, path)
    state = ck.load_training_state(path, model=m2, optimizer=opt2)
    assert state["step"] == 3 and state["note"] == "x"
    assert _steps(m2, opt2, 3, seed=2) == ref
    for a, b in zip(m.parameters(), m2.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_rng_round_trip():
    import random

    paddle.seed(11)
    np.random.seed(3)
    random.seed(4)
    st = json.loads(json.dumps(ck.rng_state()))
    want = (paddle.rand([3]).numpy(), np.random.rand(3), random.random())
    paddle.seed(99)
    np.random.seed(99)
    random.seed(99)
    ck.set_rng_state(st)
    got = (paddle.rand([3]).numpy(), np.random.rand(3), random.random())
    np.testing.assert_array_equal(want[0], got[0])
    np.testing.assert_array_equal(want[1], got[1])
    assert want[2] == got[2]


def test_latest_pointer_and_keep_last_k(tmp_path):
    m = _model()
    opt = build_optimizer(m, TrainConfig(), 0.01)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _save(root, step, m, opt, keep=2)
    assert [s for s, _ in ck.step_dirs(root)] == [3, 4]
    assert (root / "latest").read_text().strip() == "step-4"
    assert ck.find_latest(root) == root / "step-4"
    # a stale pointer falls back to the newest complete checkpoint
    (root / "latest").write_text("step-9\n")
    assert ck.find_latest(root) == root / "step-4"
    # a half-written save (killed process) is never picked and is cleaned up
    (root / ".tmp-step-5-123").mkdir()
    assert ck.find_latest(root) == root / "step-4"
    ck.remove_stale_temporaries(root)
    assert not (root / ".tmp-step-5-123").exists()
    # saving the same step again replaces it atomically
    _save(root, 4, m, opt, keep=2)
    assert ck.find_latest(root) == root / "step-4"


@pytest.mark.parametrize(
    "err,needle",
    [(errno.ENOSPC, "no space left on the device"), (errno.EACCES, "permission denied")],
)
def test_write_failure_keeps_earlier_checkpoints(tmp_path, monkeypatch, err, needle):
    m = _model()
    opt = build_optimizer(m, TrainConfig(), 0.01)
    root = tmp_path / "checkpoints"
    _save(root, 1, m, opt)
    before = sorted(os.listdir(root / "step-1"))

    import safetensors.numpy as stn

    def failing(tensors, filename, *a, **k):
        raise OSError(err, os.strerror(err), filename)

    monkeypatch.setattr(stn, "save_file", failing)
    with pytest.raises(ck.CheckpointError) as info:
        _save(root, 2, m, opt)
    msg = str(info.value)
    assert needle in msg and "step-1" in msg and "step-2" in msg
    assert sorted(os.listdir(root / "step-1")) == before
    assert not (root / "step-2").exists()
    assert [p for p in os.listdir(root) if p.startswith(".tmp")] == []
    assert ck.find_latest(root) == root / "step-1"
