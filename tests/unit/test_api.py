"""The Python API in one process: argument errors, TensorParallel's plan, pipeline items, train_step."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import paddle
import pytest
from paddle import nn

from bmtrain_cli import api
from bmtrain_cli.errors import UserError


@pytest.fixture
def fresh(monkeypatch):
    """No init_distributed yet in this test (the API keeps one context per process)."""
    monkeypatch.setattr(api.distributed, "_CTX", None)
    monkeypatch.setattr(api.distributed, "_LAYOUT", None)
    for name in ("PADDLE_TRAINERS_NUM", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


class Block(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 32)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def user_model() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(16, 8), Block(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 16))


def _kinds(splits):
    return {s.name: (s.kind, s.paired) for s in splits}


def test_import_does_not_import_paddle():
    code = "import sys, bmtrain_cli; bmtrain_cli.__all__; print('paddle' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    assert callable(__import__("bmtrain_cli").train_step)


def test_default_plan_pairs_linears_column_then_row_and_splits_embeddings():
    kinds = _kinds(api.resolve_plan(user_model(), None, 2))
    assert kinds == {
        "0": ("vocab", False),
        "1.fc1": ("column", True),
        "1.fc2": ("row", True),
        "2": ("column", True),  # Linear, Tanh, Linear: a pair across a parameter-free activation
        "4": ("row", True),
    }


def test_default_plan_leaves_what_cannot_pair_replicated():
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 5), nn.Linear(4, 8))
    kinds = _kinds(api.resolve_plan(model, None, 2))
    # a norm (with parameters) between the first two, 5 output features do not feed 4 input features
    assert set(kinds.values()) == {("replicate", False)}
    assert set(
        _kinds(api.resolve_plan(nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8)), None, 4)).values()
    ) == {("replicate", False)}  # 6 does not divide by 4
    emb = nn.Embedding(10, 4, padding_idx=0)
    assert _kinds(api.resolve_plan(nn.Sequential(emb), None, 2)) == {"0": ("replicate", False)}


def test_plan_overrides_and_unpaired_layers_gather():
    plan = {"1.fc2": "replicate", "4": "column", "0": "replicate"}
    kinds = _kinds(api.resolve_plan(user_model(), plan, 2))
    assert kinds["1.fc1"] == ("column", False)  # its partner is replicated: output gathered
    assert kinds["1.fc2"] == ("replicate", False)
    assert kinds["2"] == ("column", False) and kinds["4"] == ("column", False)
    assert kinds["0"] == ("replicate", False)
    first_match_wins = _kinds(
        api.resolve_plan(user_model(), {"1.*": "replicate", "1.fc1": "column", "2": "row"}, 2)
    )
    assert first_match_wins["1.fc1"] == ("replicate", False) and first_match_wins["2"] == ("row", False)


@pytest.mark.parametrize(
    "plan,match",
    [
        ({"1.fc1": "columns"}, "unknown kind 'columns'"),
        ({"blocks.*": "column"}, "matches no Linear/Embedding"),
        ({"0": "column"}, "is an Embedding"),
        ({"2": "vocab"}, "is a Linear"),
        ({"4": "column"}, r"output features \(16\) do not divide by 3"),
    ],
)
def test_plan_errors(plan, match):
    with pytest.raises(UserError, match=match):
        api.resolve_plan(user_model(), plan, 3 if "4" in plan else 2)


def test_pipeline_items():
    seq = user_model()
    assert api.pipeline_items(seq) == list(seq.children())

    class Stacked(nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU()
            self.layers = nn.LayerList([nn.Linear(4, 4), nn.Linear(4, 4)])

    assert len(api.pipeline_items(Stacked())) == 2

    class Outside(Stacked):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 2)

    with pytest.raises(UserError, match=r"parameters outside it: \['head'\]"):
        api.pipeline_items(Outside())


def test_init_distributed_in_one_process(fresh, capsys):
    with pytest.raises(UserError, match="call bmtrain_cli.init_distributed"):
        api.DataParallel(user_model())
    ctx = api.init_distributed()
    assert (ctx.world_size, ctx.data_world, ctx.tp_degree, ctx.pp_degree) == (1, 1, 1, 1)
    assert api.init_distributed() is ctx
    with pytest.raises(UserError, match="already called"):
        api.init_distributed(seed=1)
    mode = api.init_distributed_mode()
    assert mode.world_size == 1 and mode.backend == "none" and mode.paddle_version == paddle.__version__
    assert "rank 0 of 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tensor_parallel": 2}, "cannot be split into groups of tensor 2"),
        ({"data_parallel": 2}, "= 2 processes, but 1 were launched"),
        ({"pipeline_parallel": 0}, "pipeline_parallel must be a positive integer"),
        ({"tensor_parallel": 1.5}, "tensor_parallel must be a positive integer"),
    ],
)
def test_init_distributed_errors(fresh, kwargs, match):
    with pytest.raises(UserError, match=match):
        api.init_distributed(**kwargs)


def test_wrapper_sizes_must_match_the_topology(fresh):
    api.init_distributed()
    model = user_model()
    with pytest.raises(UserError, match=r"group_size=4\) but init_distributed set up 1 data rank"):
        api.DataParallel(model, group_size=4)
    with pytest.raises(UserError, match="needs init_distributed\\(sharding_parallel=N\\)"):
        api.DataParallel(model, sharding_stage=1)
    with pytest.raises(UserError, match="sharding_stage 2 .*bmtrain train"):
        api.DataParallel(model, sharding_stage=2)
    with pytest.raises(UserError, match="split_dim=0"):
        api.TensorParallel(model, split_dim=0)
    with pytest.raises(UserError, match=r"degree=2\) but init_distributed set up tensor_parallel=1"):
        api.TensorParallel(model, degree=2)
    with pytest.raises(UserError, match=r"stages=2\) but init_distributed set up pipeline_parallel=1"):
        api.PipelineParallel(model, stages=2)
    with pytest.raises(UserError, match="needs sample_input"):
        api.PipelineParallel(model, stages=1, partition="measured")
    assert api.DataParallel(model, group_size=1) is model
    assert api.TensorParallel(model) is model
    assert api.PipelineParallel(model, stages=1) is model


def _batch(rows: int = 4):
    rng = np.random.RandomState(0)
    return rng.randint(0, 16, (rows, 5)), rng.randint(0, 16, (rows, 5))


def _loss(logits, labels):
    return nn.functional.cross_entropy(logits.reshape([-1, 16]), labels.reshape([-1]))


def test_train_step_is_one_clipped_optimizer_step(fresh):
    api.init_distributed(seed=3)
    model = user_model()
    twin = user_model()
    twin.set_state_dict(model.state_dict())
    clip = nn.ClipGradByGlobalNorm(0.01)  # small enough to clip
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters(), grad_clip=clip)
    twin_opt = paddle.optimizer.SGD(
        learning_rate=0.1, parameters=twin.parameters(), grad_clip=nn.ClipGradByGlobalNorm(0.01)
    )
    inputs, labels = _batch()
    model = api.PipelineParallel(model, stages=1, loss_fn=_loss)
    got = api.train_step(model, (inputs, labels), None, opt)
    want = _loss(twin(paddle.to_tensor(inputs)), paddle.to_tensor(labels))
    want.backward()
    twin_opt.step()
    assert got == pytest.approx(float(want), rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6, atol=1e-7, err_msg=n)
        assert p.grad is None or float(p.grad.abs().sum()) == 0.0  # cleared


def test_train_step_errors(fresh):
    api.init_distributed()
    model = user_model()
    other = paddle.optimizer.SGD(learning_rate=0.1, parameters=user_model().parameters())
    with pytest.raises(UserError, match="does not hold the model's parameters"):
        api.train_step(model, _batch(), _loss, other)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    with pytest.raises(UserError, match="batch must be"):
        api.train_step(model, _batch()[0], _loss, opt)
    with pytest.raises(UserError, match="no loss_fn"):
        api.train_step(model, _batch(), None, opt)
    with pytest.raises(UserError, match="one-element Tensor"):
        api.train_step(model, _batch(), lambda out, y: out.mean(axis=-1), opt)
