"""Checkpoint I/O: exact optimizer/RNG round trip, atomic replace, pruning, write failures."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import paddle
import pytest

from bmtrain_cli import checkpoint_layout as ckl
from bmtrain_cli.config.schema import TrainConfig
from bmtrain_cli.train.checkpoint import optimizer_state as optst
from bmtrain_cli.train.checkpoint import rng_state as rngst
from bmtrain_cli.train.checkpoint import training_state as ck
from bmtrain_cli.train.optimizer.adamw import build_optimizer


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


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoint_files_follow_the_umask(tmp_path, mask):
    """optimizer.safetensors and the weights (written by the safetensors library, which creates 0600
    files) get the mode every other file gets: 0644 under umask 022, 0640 under 027."""
    m = _model()
    opt = build_optimizer(m, TrainConfig(), 0.01)
    _steps(m, opt, 1, seed=1)
    old = os.umask(mask)
    try:
        path = _save(tmp_path / "ckpt", 1, m, opt)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir() if p.is_file()}
    assert "optimizer.safetensors" in modes and any(
        n.endswith(".safetensors") and "optim" not in n for n in modes
    )
    assert set(modes.values()) == {0o666 & ~mask}, {n: oct(v) for n, v in modes.items()}


def test_rng_round_trip():
    import random

    paddle.seed(11)
    np.random.seed(3)
    random.seed(4)
    st = json.loads(json.dumps(rngst.rng_state()))
    want = (paddle.rand([3]).numpy(), np.random.rand(3), random.random())
    paddle.seed(99)
    np.random.seed(99)
    random.seed(99)
    rngst.set_rng_state(st)
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
    assert [s for s, _ in ckl.step_dirs(root)] == [3, 4]
    assert (root / "latest").read_text().strip() == "step-4"
    assert ckl.find_latest(root) == root / "step-4"
    # a stale pointer falls back to the newest complete checkpoint
    (root / "latest").write_text("step-9\n")
    assert ckl.find_latest(root) == root / "step-4"
    # a half-written save (killed process) is never picked and is cleaned up
    (root / ".tmp-step-5-123").mkdir()
    assert ckl.find_latest(root) == root / "step-4"
    ckl.remove_stale_temporaries(root)
    assert not (root / ".tmp-step-5-123").exists()
    # saving the same step again replaces it atomically
    _save(root, 4, m, opt, keep=2)
    assert ckl.find_latest(root) == root / "step-4"


@pytest.mark.parametrize(
    "err,needle",
    [(errno.ENOSPC, "no space left on "), (errno.EACCES, "permission denied")],
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
    with pytest.raises(ckl.CheckpointError) as info:
        _save(root, 2, m, opt)
    msg = str(info.value)
    assert needle in msg and "step-1" in msg and "step-2" in msg
    assert sorted(os.listdir(root / "step-1")) == before
    assert not (root / "step-2").exists()
    assert [p for p in os.listdir(root) if p.startswith(".tmp")] == []
    assert ckl.find_latest(root) == root / "step-1"


class _FakeCtx:
    """The facts optimizer_layout reads from a ParallelContext (tensor parallel 2 here)."""

    def __init__(self, tp=2, rank=0):
        self.world_size = tp
        self.data_world = 1
        self.tp_degree = tp
        self.pp_degree = 1
        self.sharding_degree = 1
        self.config = None
        self.rank = rank
        self.optimizer_state_portable = tp == 1
        self.pipeline_info = {}
        self.expert_group = None


def test_an_expert_parallel_part_fits_only_the_same_expert_degree():
    """dp2 x ep2 and dp4 have the same world and data ranks, but a rank's part holds other experts."""
    from types import SimpleNamespace

    plain, experts = _FakeCtx(tp=1), _FakeCtx(tp=1)
    for ctx in (plain, experts):
        ctx.world_size = ctx.data_world = 4
    experts.expert_group, experts.optimizer_state_portable = SimpleNamespace(degree=2), False
    split = optst.optimizer_layout(experts)
    assert split["expert_parallel"] == 2 and split["portable"] is False
    assert optst.same_layout(split, dict(split))
    assert not optst.same_layout(split, optst.optimizer_layout(plain))
    assert "expert_parallel 2" in optst.describe_layout(split)


def test_split_optimizer_state_per_rank_and_layout_check(tmp_path):
    cfg = TrainConfig(learning_rate=0.05)
    root = tmp_path / "checkpoints"
    layout = optst.optimizer_layout(_FakeCtx(tp=2))
    assert layout["portable"] is False and layout["tensor_parallel"] == 2
    ranks = []
    for rank in (0, 1):  # two "ranks", each with its own part of the state
        m = _model(seed=rank)
        opt = build_optimizer(m, cfg, 0.05)
        _steps(m, opt, 2, seed=10 + rank)
        optst.write_optimizer_shard(root, 2, rank, opt, m)
        ranks.append((m, opt))
    path = ck.save_checkpoint(root, 2, model=ranks[0][0], optimizer=ranks[0][1], state={}, layout=layout)
    assert not (path / ckl.OPTIMIZER_FILE).exists()
    assert sorted(p.name for p in path.glob("optimizer-rank-*")) == [
        "optimizer-rank-0.safetensors",
        "optimizer-rank-1.safetensors",
    ]
    assert not ckl.shard_staging_dir(root, 2).exists()
    saved = ck.read_state(path)["optimizer_layout"]
    assert saved["tensor_parallel"] == 2 and saved["portable"] is False

    # same layout: rank 1 gets rank 1's moments back and continues exactly
    m1, opt1 = ranks[1]
    weights = {k: v.numpy().copy() for k, v in m1.state_dict().items()}
    ref = _steps(m1, opt1, 2, seed=20)
    m2 = _model(seed=9)
    m2.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})  # rank 1's weights at step 2
    opt2 = build_optimizer(m2, cfg, 0.05)
    state = ck.load_training_state(path, model=m2, optimizer=opt2, layout=layout, rank=1)
    assert state["optimizer_restored"] is True
    assert _steps(m2, opt2, 2, seed=20) == ref

    # another layout: nothing restored, and the message says so
    m3 = _model()
    opt3 = build_optimizer(m3, cfg, 0.05)
    state = ck.load_training_state(
        path, model=m3, optimizer=opt3, layout=optst.optimizer_layout(_FakeCtx(tp=1))
    )
    assert state["optimizer_restored"] is False
    assert ck.NOT_CARRIED in state["optimizer_message"] and "tensor_parallel 2" in state["optimizer_message"]
    assert not opt3.state_dict() or all(
        float(np.abs(v.numpy()).sum()) == 0 for k, v in opt3.state_dict().items() if "moment" in k
    )


def test_whole_state_is_not_reused_under_a_split_layout_and_missing_parts(tmp_path):
    m = _model()
    opt = build_optimizer(m, TrainConfig(), 0.01)
    _steps(m, opt, 1, seed=0)
    whole = _save(tmp_path / "a", 1, m, opt)
    assert ck.read_state(whole)["optimizer_layout"]["portable"] is True
    split = optst.optimizer_layout(_FakeCtx(tp=2))
    state = ck.load_training_state(whole, model=m, optimizer=opt, layout=split, rank=0)
    assert state["optimizer_restored"] is False and ck.NOT_CARRIED in state["optimizer_message"]
    # only rank 0 wrote its part (e.g. ranks on another node without a shared disk)
    optst.write_optimizer_shard(tmp_path / "b", 1, 0, opt, m)
    path = ck.save_checkpoint(tmp_path / "b", 1, model=m, optimizer=opt, state={}, layout=split)
    assert ck.read_state(path)["optimizer_layout"]["optimizer_files"] == []
    state = ck.load_training_state(path, model=m, optimizer=opt, layout=split, rank=0)
    assert state["optimizer_restored"] is False and "missing" in state["optimizer_message"]


def test_a_stage_part_is_not_reused_under_another_cut(tmp_path):
    """Under pipeline parallel a rank's optimizer part belongs to the layers of its stage: after a
    rebalance (train/loop/pipeline_rebalance.py) a resume cut elsewhere must not take it for its own layers."""

    def pp2(bounds):
        ctx = _FakeCtx(tp=1)
        ctx.world_size, ctx.pp_degree, ctx.optimizer_state_portable = 2, 2, False
        ctx.pipeline_info = {"boundaries": bounds}
        return optst.optimizer_layout(ctx)

    m = _model()
    opt = build_optimizer(m, TrainConfig(), 0.01)
    _steps(m, opt, 1, seed=0)
    for rank in (0, 1):
        optst.write_optimizer_shard(tmp_path, 1, rank, opt, m)
    path = ck.save_checkpoint(tmp_path, 1, model=m, optimizer=opt, state={}, layout=pp2([0, 6, 9]))
    assert ck.read_state(path)["optimizer_layout"]["pipeline_bounds"] == [0, 6, 9]
    state = ck.load_training_state(path, model=m, optimizer=opt, layout=pp2([0, 4, 9]), rank=1)
    assert state["optimizer_restored"] is False
    assert "stage boundaries [0, 6, 9]" in state["optimizer_message"]
    state = ck.load_training_state(path, model=m, optimizer=opt, layout=pp2([0, 6, 9]), rank=1)
    assert state["optimizer_restored"] is True
