"""Build fleet's hybrid topology (dp x tp x pp x sharding) from parallel_config.

``init_distributed(config)`` is called once per launched process: it checks the launched world size
against the config, applies the CPU compatibility layer when Paddle has no GPU, initialises fleet with a
DistributedStrategy whose hybrid_configs carry the degrees, starts the fault watchdog and returns a
ParallelContext describing this rank.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from bmtrain_cli.config.derived import derive
from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.context import ParallelContext, launched_world_size


def hybrid_configs(config: Config) -> Dict[str, Any]:
    """The degrees as fleet's hybrid_configs dict (plain data, testable without processes)."""
    par = config.parallel
    derived = derive(config)
    out: Dict[str, Any] = {
        # context parallel lives inside fleet's data axis (context innermost): the gradient and loss
        # reductions over data x context then equal one process, each rank holding its share of the tokens
        # so do the expert groups (consecutive data ranks): each of their ranks reads its own data
        "dp_degree": par.data_parallel * par.context_parallel * par.expert_parallel,
        "mp_degree": par.tensor_parallel,
        "pp_degree": par.pipeline_parallel,
        "sharding_degree": par.sharding_parallel,
    }
    if par.pipeline_parallel > 1:
        accumulate = pipeline_micro_batches(config)
        per_rank_batch = derived.global_batch_size // derived.data_ranks
        out["pp_configs"] = {
            "delay_scale_loss": False,
            "enable_timer": False,
        }
        out["_pipeline"] = {"accumulate_steps": accumulate, "micro_batch_size": per_rank_batch // accumulate}
    return out


def pipeline_micro_batches(config: Config) -> int:
    """Micro-batches per optimizer step on each pipeline (default: the gradient accumulation steps)."""
    derived = derive(config)
    if config.parallel.pipeline_micro_batches is not None:
        return config.parallel.pipeline_micro_batches
    return derived.grad_accum_steps


def build_strategy(config: Config) -> Any:
    """A fleet DistributedStrategy for this config."""
    from paddle.distributed import fleet

    from bmtrain_cli.parallel.sharding import apply_sharding_strategy

    # Any: Paddle's stub types hybrid_configs without the pp_configs and mp_configs it holds
    strategy: Any = fleet.DistributedStrategy()
    configs = hybrid_configs(config)
    pipeline = configs.pop("_pipeline", None)
    pp_configs = configs.pop("pp_configs", None)
    strategy.hybrid_configs = configs
    if pp_configs:
        hc = strategy.hybrid_configs
        for key, value in pp_configs.items():
            if hasattr(hc["pp_configs"], key):
                setattr(hc["pp_configs"], key, value)
    if pipeline is not None:
        strategy.pipeline_configs = pipeline
    # Inputs are identical on the ranks of one model-parallel group (the loader shards by data rank only).
    mp = strategy.hybrid_configs["mp_configs"]
    if hasattr(mp, "need_broadcast_data"):
        mp.need_broadcast_data = False
    apply_sharding_strategy(strategy, config)
    strategy.find_unused_parameters = False
    return strategy


def init_parallel(config: Config) -> ParallelContext:
    """This process's ParallelContext: a single-process one without touching any distributed state, or
    fleet's hybrid topology when launched with several processes (:func:`init_distributed`)."""
    if config.parallel.world_size == 1 and launched_world_size() == 1:
        return ParallelContext(config=config)
    return init_distributed(config)


def init_distributed(config: Config) -> ParallelContext:
    """Initialise fleet for this process and return its ParallelContext."""
    from bmtrain_cli.parallel import faults

    launched = launched_world_size()
    par = config.parallel
    if launched != par.world_size:
        raise UserError(
            f"{launched} processes were launched but parallel_config asks for {par.world_size} (data "
            f"{par.data_parallel} x tensor {par.tensor_parallel} x pipeline {par.pipeline_parallel} x "
            f"sharding {par.sharding_parallel} x context {par.context_parallel} x expert {par.expert_parallel}); "
            "launch with `bmtrain run`, "
            "which starts the right number"
        )
    ctx = start_fleet(config, faults.start_watchdog)
    faults.check_agreement(ctx, config)
    return ctx


def start_fleet(config: Config, start_watchdog: Optional[Callable[[Config], Any]] = None) -> ParallelContext:
    """fleet.init with this config's degrees (the CPU compatibility layer first when Paddle has no GPU)
    and the rank's ParallelContext. Shared by ``bmtrain train`` (above) and the Python API
    (bmtrain_cli/api/distributed.py); ``start_watchdog(config)`` runs before fleet.init so that a hang there is seen."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    from bmtrain_cli.parallel import cpu_compat

    on_cpu = cpu_compat.apply_if_cpu()
    if on_cpu:
        paddle.set_device("cpu")
    watchdog = start_watchdog(config) if start_watchdog is not None else None
    from bmtrain_cli.quiet import FLEET_INIT_NOISE, NOISE, filtered_stderr

    # each node's local rank 0 writes to that node's console: keep fleet's start-up report there out of
    # the way; the other ranks' worker logs keep it (topology, groups) for debugging
    console = os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_TRAINER_ID", "0")) == "0"
    with filtered_stderr(FLEET_INIT_NOISE if console else NOISE):
        strategy = build_strategy(config)
        fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dp_rank, dp_world = hcg.get_data_parallel_rank(), hcg.get_data_parallel_world_size()
    sh_rank, sh_world = hcg.get_sharding_parallel_rank(), hcg.get_sharding_parallel_world_size()
    ctx = ParallelContext(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        data_rank=dp_rank * sh_world + sh_rank,
        data_world=dp_world * sh_world,
        tp_rank=hcg.get_model_parallel_rank(),
        tp_degree=hcg.get_model_parallel_world_size(),
        pp_rank=hcg.get_stage_id(),
        pp_degree=hcg.get_pipe_parallel_world_size(),
        hcg=hcg,
        config=config,
        strategy=strategy,
        on_cpu=on_cpu,
        watchdog=watchdog,
    )
    if config.parallel.context_parallel > 1:
        from bmtrain_cli.parallel.ring_attention import context_ring

        ulysses_on_gloo = on_cpu and config.parallel.context_parallel_mode == "ulysses"
        ctx.context_ring = context_ring(hcg, config.parallel.context_parallel, pairs=ulysses_on_gloo)
    if config.parallel.expert_parallel > 1:
        from bmtrain_cli.parallel.expert_parallel import expert_group

        ctx.expert_group = expert_group(hcg, config.parallel.expert_parallel, on_cpu)
    if watchdog is not None:
        watchdog.set_rank(ctx.rank, ctx.world_size)
    return ctx
