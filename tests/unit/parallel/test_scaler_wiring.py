"""The fp16 loss scaler per layout (fleet.distributed_scaler, GroupShardedScaler through
group_sharded_parallel(scaler=...), the scaler given to the pipeline's train_batch under autocast) and an
fp16 overflow skipping the update without stopping the run. GPU-only calls are replaced by recorders: the
wiring, not Paddle's kernels, is what these tests check."""

from __future__ import annotations

import contextlib
import math
import types

import paddle
import pytest

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel import sharding
from bmtrain_cli.parallel.context import ParallelContext
from bmtrain_cli.train.loop import step as step_mod
from bmtrain_cli.train.loop.stopping import TrainingStopped
from bmtrain_cli.train.optimizer.adamw import Precision, found_inf


def _cfg(par) -> Config:
    return Config.model_validate({"parallel_config": par, "train_config": {}})


@pytest.mark.parametrize(
    "tp,pp,shard,stage,kind",
    [
        (1, 1, 1, 1, "plain"),
        (2, 1, 1, 1, "distributed"),
        (1, 2, 1, 1, "distributed"),
        (1, 1, 2, 1, "distributed"),
        (1, 1, 2, 2, "group_sharded"),
        (1, 1, 2, 3, "group_sharded"),
        (2, 2, 2, 1, "distributed"),
    ],
)
def test_scaler_kind_per_layout(tp, pp, shard, stage, kind):
    assert sharding.scaler_kind(tp, pp, shard, stage) == kind


def test_distributed_scaler_applied_for_tensor_parallel_and_stage1(monkeypatch):
    from paddle.distributed import fleet

    wrapped = []
    monkeypatch.setattr(fleet, "distributed_scaler", lambda s: wrapped.append(s) or ("fleet", s))
    scaler = object()
    tp = ParallelContext(world_size=2, tp_degree=2, config=_cfg({"tensor_parallel": 2}))
    assert tp.wrapping.wrap_scaler(scaler) == ("fleet", scaler)
    st1 = ParallelContext(world_size=2, config=_cfg({"sharding_parallel": 2, "sharding_stage": 1}))
    assert st1.wrapping.wrap_scaler(scaler) == ("fleet", scaler)
    dp = ParallelContext(world_size=2, config=_cfg({"data_parallel": 2}))
    assert (
        dp.wrapping.wrap_scaler(scaler) is scaler
    )  # plain data parallel: gradients are summed before unscale
    assert tp.wrapping.wrap_scaler(None) is None  # no fp16, nothing to wrap
    assert len(wrapped) == 2


def test_group_sharded_gets_the_scaler_and_returns_paddles(monkeypatch):
    import paddle.distributed.sharding as pds

    seen = {}

    def fake_group_sharded_parallel(model, optimizer, **kw):
        seen.update(kw)
        return model, optimizer, ("GroupShardedScaler", kw["scaler"])

    monkeypatch.setattr(pds, "group_sharded_parallel", fake_group_sharded_parallel)
    ctx = ParallelContext(
        world_size=2, data_world=2, config=_cfg({"sharding_parallel": 2, "sharding_stage": 2})
    )
    scaler = object()
    model, opt, got = ctx.wrapping.wrap_model_and_optimizer("model", "opt", scaler)
    assert seen["scaler"] is scaler and seen["level"] == "os_g"
    assert got == ("GroupShardedScaler", scaler)
    assert isinstance(opt, sharding.GradSumOptimizer)
    assert seen["group"] is None and seen["dp_group"] is None  # one process: no groups


class _Hcg:
    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_sharding_parallel_group(self) -> str:
        return "sharding-group"

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_group(self) -> str:
        return "dp-group"


@pytest.mark.parametrize("dp", [1, 2])
def test_group_sharded_reduces_over_the_data_parallel_group_too(monkeypatch, dp):
    """data_parallel x sharding stage 2/3: group_sharded_parallel gets the data-parallel group, whose
    all-reduce (averaging, like the sharding reduce) the loss's data_world factor turns into the sum."""
    import paddle.distributed.sharding as pds

    seen = {}
    monkeypatch.setattr(pds, "group_sharded_parallel", lambda m, o, **kw: seen.update(kw) or (m, o, None))
    par = {"data_parallel": dp, "sharding_parallel": 2, "sharding_stage": 3}
    ctx = ParallelContext(world_size=2 * dp, data_world=2 * dp, hcg=_Hcg(dp), config=_cfg(par))
    ctx.wrapping.wrap_model_and_optimizer("model", "opt", None)
    assert seen["group"] == "sharding-group"
    assert seen["dp_group"] == ("dp-group" if dp > 1 else None)
    assert sharding.backward_factor(ctx) == 2 * dp


class _RecordingPrecision:
    def __init__(self, overflow: bool) -> None:
        self.scaler = object()
        self.inside = False
        self._overflow = overflow

    @contextlib.contextmanager
    def autocast(self):
        self.inside = True
        yield
        self.inside = False

    def overflowed(self) -> bool:
        return self._overflow


def _pipeline_parts(overflow: bool, recorded_norm):
    precision = _RecordingPrecision(overflow)
    calls = {}

    class Wrapping:
        def pipeline_step(self, model, micro, optimizer, objective=None, scaler=None):
            calls["scaler"] = scaler
            calls["autocast"] = precision.inside
            return 6.0, 3.0

        def pipeline_aux_losses(self, model):
            return None  # a dense model: no load-balancing loss to log

    class Collectives:
        def all_reduce_sum(self, value):
            return value

        context_degree = 1

    stepper = types.SimpleNamespace(set_lr=lambda lr: None, grad_norm=lambda: recorded_norm)
    parts = types.SimpleNamespace(
        ctx=types.SimpleNamespace(wrapping=Wrapping(), collectives=Collectives(), context_degree=1),
        schedule=lambda step: 0.1,
        optim=types.SimpleNamespace(stepper=stepper, precision=precision),
        objective=types.SimpleNamespace(pipeline=lambda ctx, micro_batch_size: None),
        model=types.SimpleNamespace(wrapped="pipe"),
        runtime=types.SimpleNamespace(checkpoint_dir="ckpt"),
        config=types.SimpleNamespace(train=types.SimpleNamespace(micro_batch_size=1)),
    )
    return parts, calls, precision


def test_pipeline_step_runs_under_autocast_and_passes_the_scaler():
    import numpy as np

    parts, calls, precision = _pipeline_parts(overflow=False, recorded_norm=1.5)
    micro = [{"attention_mask": np.ones((1, 4), dtype="int64")}]
    out = step_mod.pipeline_step(parts, 0, micro)
    assert calls["scaler"] is precision.scaler and calls["autocast"] is True
    assert out.applied and out.grad_norm == 1.5 and out.loss == 2.0


def test_pipeline_fp16_overflow_skips_the_update_and_goes_on():
    import numpy as np

    parts, _, _ = _pipeline_parts(overflow=True, recorded_norm=math.inf)
    out = step_mod.pipeline_step(parts, 0, [{"attention_mask": np.ones((1, 4), dtype="int64")}])
    assert not out.applied and out.finite and math.isnan(out.grad_norm)


def test_fleet_grad_norm_inf_without_overflow_still_stops():
    parts, _, _ = _pipeline_parts(overflow=False, recorded_norm=math.inf)
    with pytest.raises(TrainingStopped, match="gradient norm is inf"):
        step_mod.fleet_grad_norm(parts, 3)
    assert math.isnan(step_mod.fleet_grad_norm(parts, 3, overflow=True))


def test_found_inf_reads_bools_and_tensors():
    assert not found_inf(None) and found_inf(True) and not found_inf(False)
    assert found_inf(paddle.to_tensor([True])) and not found_inf(paddle.to_tensor([0], dtype="int32"))
    p = Precision("fp32")
    assert not p.overflowed()
    p.scaler = types.SimpleNamespace(_cache_found_inf=paddle.to_tensor([True]))
    assert p.overflowed()


def test_group_sharded_sums_through_the_loss_not_by_rescaling_grads():
    """Stage 2/3: Paddle moves reduced gradients out of p.grad (freed, offloaded, or sliced into
    bw_storage), so the sum over data ranks comes from the loss (backward_factor), and the wrapper leaves
    p.grad alone; other layouts keep rescaling the reduced p.grad."""
    st2 = ParallelContext(
        world_size=4, data_world=4, config=_cfg({"sharding_parallel": 4, "sharding_stage": 2})
    )
    st1 = ParallelContext(
        world_size=4, data_world=4, config=_cfg({"sharding_parallel": 4, "sharding_stage": 1})
    )
    assert sharding.backward_factor(st2) == 4.0 and sharding.backward_factor(st1) == 1.0
    assert sharding.backward_factor(ParallelContext()) == 1.0

    class Inner:
        def __init__(self, params):
            self._parameter_list = params
            self.stepped = False

        def step(self):
            self.stepped = True

    def grads_after(factor):
        p = paddle.create_parameter([2], "float32")
        (p * paddle.to_tensor([1.0, 2.0])).sum().backward()
        inner = Inner([p])
        sharding.GradSumOptimizer(inner, st2, factor=factor).step()
        assert inner.stepped
        return p.grad.numpy().tolist()

    assert grads_after(1.0) == [1.0, 2.0]  # group-sharded: untouched
    assert grads_after(None) == [4.0, 8.0]  # fleet's optimizers: rescaled by the data-rank count
