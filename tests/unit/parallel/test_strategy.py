"""Strategy and argument building for fleet (no processes): degrees, pipeline, sharding stages."""

from __future__ import annotations

import pytest

from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.context import ParallelContext
from bmtrain_cli.parallel.faults import config_hash, data_fingerprint
from bmtrain_cli.parallel.sharding import group_sharded, group_sharded_arguments, uses_group_sharded
from bmtrain_cli.parallel.topology import build_strategy, hybrid_configs


def _cfg(par, train=None) -> Config:
    return Config.model_validate({"parallel_config": par, "train_config": train or {}})


def test_hybrid_degrees_and_pipeline_micro_batches():
    cfg = _cfg(
        {"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2, "pipeline_micro_batches": 4},
        {"micro_batch_size": 1, "global_batch_size": 16},
    )
    hc = hybrid_configs(cfg)
    assert (hc["dp_degree"], hc["mp_degree"], hc["pp_degree"], hc["sharding_degree"]) == (2, 2, 2, 1)
    assert hc["_pipeline"] == {"accumulate_steps": 4, "micro_batch_size": 2}
    strategy = build_strategy(cfg)
    assert strategy.hybrid_configs["mp_degree"] == 2
    assert strategy.pipeline_configs["accumulate_steps"] == 4


@pytest.mark.parametrize(
    "stage,opt,params,level,offload",
    [(2, False, False, "os_g", False), (2, True, False, "os_g", True), (3, False, True, "p_g_os", True)],
)
def test_group_sharded_arguments(stage, opt, params, level, offload):
    cfg = _cfg(
        {"sharding_parallel": 2, "sharding_stage": stage, "offload_optimizer": opt, "offload_params": params}
    )
    assert uses_group_sharded(cfg)
    args = group_sharded_arguments(cfg)
    assert args["level"] == level and args["offload"] is offload
    build_strategy(cfg)  # the strategy for stages 2/3 builds as well


def test_stage1_is_fleet_sharding_not_group_sharded():
    cfg = _cfg({"sharding_parallel": 2, "sharding_stage": 1})
    assert not uses_group_sharded(cfg)
    assert hybrid_configs(cfg)["sharding_degree"] == 2


def test_stage3_on_cpu_is_a_clear_error():
    cfg = _cfg({"sharding_parallel": 2, "sharding_stage": 3})
    ctx = ParallelContext(world_size=2, config=cfg, on_cpu=True)
    with pytest.raises(UserError, match="needs a GPU build"):
        group_sharded(object(), object(), ctx)


def test_config_and_data_fingerprints(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n')
    a = _cfg({}, {"data_path": str(data)})
    b = _cfg({}, {"data_path": str(data), "seed": 1})
    assert config_hash(a) != config_hash(b)
    fp = data_fingerprint(a)
    data.write_text('{"input": "a", "output": "c"}\n')
    assert data_fingerprint(a) != fp


def test_single_process_context_is_inert():
    ctx = ParallelContext()
    assert ctx.collectives.all_reduce_sum(3.0) == 3.0
    model = object()
    assert ctx.wrapping.wrap_model(model) is model
    assert ctx.wrapping.checkpoint_weights_writer(model) is None
    assert ctx.optimizer_state_portable


@pytest.mark.parametrize("dp,sharding,cp", [(1, 1, 2), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 2, 4)])
def test_the_ranks_of_a_context_group_read_one_loader_shard(dp, sharding, cp):
    """On fleet's topology (default order: data, pipe, sharding, sep, model; context inside data), the
    ranks of each context group (parallel/ring_attention.context_ring) read the same loader shard, and
    the groups read every shard once."""
    from types import SimpleNamespace

    from paddle.distributed.fleet.base.topology import CommunicateTopology

    topo = CommunicateTopology(["data", "pipe", "sharding", "sep", "model"], [dp * cp, 1, sharding, 1, 1])
    cfg = _cfg({"data_parallel": dp, "sharding_parallel": sharding, "context_parallel": cp})
    shards = []
    for data_ranks in topo.get_comm_list("data"):
        for i in range(0, len(data_ranks), cp):
            group = data_ranks[i : i + cp]
            read = set()
            for r, rank in enumerate(group):
                coord = topo.get_coord(rank)
                ctx = ParallelContext(
                    data_rank=coord.data * sharding + coord.sharding,
                    data_world=dp * cp * sharding,
                    context_ring=SimpleNamespace(degree=cp, rank=r),
                    config=cfg,
                )
                assert ctx.loader_world == dp * sharding
                read.add(ctx.loader_rank)
            assert len(read) == 1, (group, read)
            shards.append(read.pop())
    assert sorted(shards) == list(range(dp * sharding))
