"""init_distributed / init_distributed_mode: the degrees as a parallel_config, fleet started through
``parallel.topology.start_fleet``, every rank seeded alike; the process's one ParallelContext."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import ParallelCtx, Topology

_CTX: Optional[ParallelCtx] = None
_LAYOUT: Optional[Dict[str, int]] = None


def init_distributed(
    data_parallel: Optional[int] = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sharding_parallel: int = 1,
    seed: int = 0,
) -> ParallelCtx:
    """Set up this process's place in the launched world (``python -m paddle.distributed.launch`` or
    ``fleetrun``; one process without a launcher) and return its ParallelCtx (ranks, groups).

    ``data_parallel`` defaults to the processes left after tensor x pipeline x sharding. Seeds Paddle,
    numpy and random with ``seed`` on every rank (fleet's model-parallel generator gets a per-rank seed
    derived from it), so models built afterwards start identical everywhere."""
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.parallel.context import ParallelContext, launched_world_size

    global _CTX, _LAYOUT
    degrees = {
        "tensor_parallel": tensor_parallel,
        "pipeline_parallel": pipeline_parallel,
        "sharding_parallel": sharding_parallel,
    }
    if data_parallel is not None:
        degrees["data_parallel"] = data_parallel
    for name, value in degrees.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"init_distributed: {name} must be a positive integer, got {value!r}")
    world = launched_world_size()
    model_ranks = tensor_parallel * pipeline_parallel * sharding_parallel
    if data_parallel is None:
        if world % model_ranks:
            raise UserError(
                f"init_distributed: {world} launched process(es) cannot be split into groups of tensor "
                f"{tensor_parallel} x pipeline {pipeline_parallel} x sharding {sharding_parallel} = "
                f"{model_ranks}; launch a multiple of {model_ranks} processes"
            )
        data_parallel = world // model_ranks
    layout = {"data_parallel": data_parallel, **degrees, "seed": seed}
    if _CTX is not None:
        if layout != _LAYOUT:
            raise UserError(
                f"init_distributed was already called with {_LAYOUT}; cannot re-initialise as {layout}"
            )
        return _CTX
    if data_parallel * model_ranks != world:
        raise UserError(
            f"init_distributed: data {data_parallel} x tensor {tensor_parallel} x pipeline {pipeline_parallel}"
            f" x sharding {sharding_parallel} = {data_parallel * model_ranks} processes, but {world} were "
            "launched (python -m paddle.distributed.launch --nproc_per_node N)"
        )
    layout.pop("seed")
    config = Config.model_validate({"parallel_config": layout})
    if world == 1:
        ctx = ParallelContext(config=config)
    else:
        _check_gloo_groups(config)
        from bmtrain_cli.parallel.topology import start_fleet

        ctx = start_fleet(config)
    _seed_everything(ctx, seed)
    _CTX, _LAYOUT = ctx, {**layout, "seed": seed}
    return ctx


def _check_gloo_groups(config: Any) -> None:
    """The CPU build's gloo cannot connect a group of 3+ ranks that is not the whole world (the same
    refusal as validate-config / bmtrain run, config/checks.py)."""
    from bmtrain_cli.config.checks import cpu_gloo_subgroups
    from bmtrain_cli.machine import paddle_has_gpu

    par = config.parallel
    if par.world_size > 2 and not paddle_has_gpu():
        groups = cpu_gloo_subgroups(par)
        if groups:
            raise UserError(
                f"init_distributed: this layout needs process groups of {' and '.join(groups)} ranks inside "
                f"a world of {par.world_size}; Paddle's CPU build (gloo) cannot connect a group of 3 or more "
                "ranks that is not the whole world (use degrees of 2 beside each other, or one degree equal "
                "to the world size)"
            )


def _seed_everything(ctx: Topology, seed: int) -> None:
    import random

    import numpy as np
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)  # fleet.init re-seeds Paddle at random under tensor parallel: seed after it
    if ctx.tp_degree > 1:
        from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker

        tracker = get_rng_state_tracker()
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, seed + 1 + ctx.tp_rank * ctx.pp_degree + ctx.pp_rank)


def context(caller: str) -> ParallelCtx:
    if _CTX is None:
        raise UserError(f"{caller}: call bmtrain_cli.init_distributed() first")
    return _CTX


@dataclass(frozen=True)
class DistributedMode:
    """What init_distributed_mode reports for this rank."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: str  # "gpu" or "cpu"
    device_count: int  # visible GPUs, or CPU cores on a machine without one
    backend: str  # "nccl" or "gloo" ("none" in one process)
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    sharding_parallel: int
    data_rank: int
    tensor_rank: int
    pipeline_stage: int
    paddle_version: str
    paddle_build: str  # "CUDA 12.6" or "CPU", and the commit

    def __str__(self) -> str:
        unit = "GPU(s)" if self.device_kind == "gpu" else "CPU core(s)"
        return (
            f"rank {self.rank} of {self.world_size} (local {self.local_rank}): {self.device_count} {unit}, "
            f"backend {self.backend}; data {self.data_parallel} x tensor {self.tensor_parallel} x pipeline "
            f"{self.pipeline_parallel} x sharding {self.sharding_parallel} (data rank {self.data_rank}, "
            f"tensor rank {self.tensor_rank}, stage {self.pipeline_stage}); Paddle {self.paddle_version} "
            f"({self.paddle_build})"
        )


def init_distributed_mode() -> DistributedMode:
    """Initialise with the defaults when init_distributed was not called, print this rank's view (rank,
    world size, devices, degrees, Paddle build) and return it."""
    import paddle

    from bmtrain_cli.machine import gpu_available

    ctx = _CTX if _CTX is not None else init_distributed()
    assert ctx.config is not None  # init_distributed's context holds its layout as a config
    par = ctx.config.parallel
    gpu = gpu_available()
    cuda = paddle.version.cuda()
    build = f"CUDA {cuda}" if paddle.device.is_compiled_with_cuda() and cuda != "False" else "CPU"
    mode = DistributedMode(
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_rank=int(os.environ.get("PADDLE_LOCAL_RANK", "0")),
        device_kind="gpu" if gpu else "cpu",
        device_count=paddle.device.cuda.device_count() if gpu else (os.cpu_count() or 1),
        backend=("nccl" if gpu else "gloo") if ctx.world_size > 1 else "none",
        data_parallel=par.data_parallel,
        tensor_parallel=par.tensor_parallel,
        pipeline_parallel=par.pipeline_parallel,
        sharding_parallel=par.sharding_parallel,
        data_rank=ctx.data_rank,
        tensor_rank=ctx.tp_rank,
        pipeline_stage=ctx.pp_rank,
        paddle_version=paddle.__version__,
        paddle_build=f"{build}, commit {paddle.version.commit[:10]}",
    )
    print(mode, flush=True)
    return mode
