"""ZeRO sharding: stage 1 through fleet's sharding optimizer (DygraphShardingOptimizer, picked by fleet
when hybrid_configs.sharding_degree > 1); stages 2 and 3, and CPU offload, through Paddle's group-sharded
API (``paddle.distributed.sharding.group_sharded_parallel``).

Paddle's CPU build refuses group_sharded_parallel ("only support gpu, xpu and custom_device"), so stages
2/3 stop with a clear error there; :func:`group_sharded_arguments` is plain data and is tested on CPU.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import ParallelCtx

LEVELS = {2: "os_g", 3: "p_g_os"}  # group_sharded_parallel levels: optimizer+grads, +parameters


def uses_group_sharded(config: Config) -> bool:
    par = config.parallel
    return par.sharding_parallel > 1 and par.sharding_stage in (2, 3)


def group_sharded_arguments(config: Config) -> Dict[str, Any]:
    """Keyword arguments for group_sharded_parallel (besides model, optimizer and group)."""
    par = config.parallel
    if par.sharding_stage not in LEVELS:
        raise ValueError(f"sharding stage {par.sharding_stage} is not handled by group_sharded_parallel")
    return {
        "level": LEVELS[par.sharding_stage],
        # stage 2: optimizer states on the host; stage 3: parameters and optimizer states on the host
        "offload": bool(par.offload_optimizer or par.offload_params),
        "sync_buffers": True,
        "segment_size": 2**20,
        "sync_comm": False,
    }


def scaler_kind(tp_degree: int, pp_degree: int, sharding_degree: int, sharding_stage: int) -> str:
    """How the fp16 loss scaler is wrapped for a layout (as PaddleFormers' trainer does):

    * ``group_sharded``: sharding stage 2/3; group_sharded_parallel(scaler=...) returns Paddle's
      GroupShardedScaler, whose unscale reads the sharded optimizer's slices and all-reduces found_inf;
    * ``distributed``: tensor or pipeline parallel, or sharding stage 1: fleet.distributed_scaler, whose
      unscale all-reduces found_inf (MAX) over all ranks, so every rank skips the same overflowing step
      (without it each rank decides on its own shard and replicated weights drift apart);
    * ``plain``: one process or plain data parallel (gradients are summed before unscale_, so found_inf
      is already the same on every rank; fleet.distributed_scaler leaves DATA_PARALLEL unchanged too).
    """
    if sharding_degree > 1 and sharding_stage in (2, 3):
        return "group_sharded"
    if tp_degree > 1 or pp_degree > 1 or sharding_degree > 1:
        return "distributed"
    return "plain"


def wrap_scaler(scaler: Any, ctx: ParallelCtx) -> Any:
    """The layout's scaler (see :func:`scaler_kind`); group-sharded layouts get theirs from
    :func:`group_sharded`. None stays None (no fp16)."""
    if scaler is None or ctx.world_size <= 1 or ctx.config is None:
        return scaler
    par = ctx.config.parallel
    kind = scaler_kind(ctx.tp_degree, ctx.pp_degree, par.sharding_parallel, par.sharding_stage)
    if kind != "distributed":
        return scaler
    from paddle.distributed import fleet

    return fleet.distributed_scaler(scaler)


def apply_sharding_strategy(strategy: Any, config: Config) -> None:
    """Sharding options in fleet's DistributedStrategy (stage 1 is driven by hybrid_configs alone)."""
    par = config.parallel
    if par.sharding_parallel <= 1:
        return
    sc = strategy.hybrid_configs["sharding_configs"]
    if par.sharding_stage == 1 and hasattr(sc, "tensor_fusion"):
        sc.tensor_fusion = False  # per-parameter ownership: exact fp32 equivalence, simple state dicts
    if uses_group_sharded(config) and par.offload_optimizer and hasattr(sc, "offload"):
        sc.offload = True


class GradSumOptimizer:
    """fleet's optimizers average gradients over the data ranks; scale them first so the reduced result
    is the sum (the context's gradient convention). ``grad_norm()`` is the global norm that fleet's clip
    measured in the last step (parallel/grad_norm.py)."""

    def __init__(
        self, inner: Any, ctx: ParallelCtx, recorder: Any = None, factor: Optional[float] = None
    ) -> None:
        self._inner = inner
        self._ctx = ctx
        self._recorder = recorder
        # the rescaling of the reduced gradients (default: the data-rank count); 1.0 under sharding
        # stage 2/3, whose gradients are scaled through the loss instead (see backward_factor)
        self._factor = float(ctx.data_world) if factor is None else float(factor)

    def grad_norm(self) -> Optional[float]:
        """None when nothing was measured (no recorder, or the step's clip did not run)."""
        if self._recorder is None:
            return None
        from bmtrain_cli.parallel.grad_norm import take_norm

        return take_norm(self._recorder)

    def _scaled_parameters(self) -> Any:
        inner = self._inner
        while hasattr(inner, "_inner_opt") and not hasattr(inner, "_parameter_list"):
            inner = inner._inner_opt
        return getattr(inner, "_parameter_list", None) or []

    def step(self) -> None:
        import paddle

        factor = self._factor
        if factor != 1.0:
            with paddle.no_grad():
                for p in self._scaled_parameters():
                    if p.grad is not None:
                        p.grad.scale_(factor)
        self._inner.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def backward_factor(ctx: ParallelCtx) -> float:
    """What the trainer multiplies each micro-batch's loss by before backward so that the reduced gradients
    are the sum over data ranks: the data-rank count under sharding stage 2/3, else 1.

    Paddle's group-sharded stages reduce gradients inside backward (averaging: scale 1/nranks, then
    reduce) and then move them where ``p.grad`` no longer reaches: stage 2 frees the gradients a rank
    does not own and, with offload, moves the owned ones into host accumulators; stage 3 keeps each
    rank's slice in ``param.bw_storage`` and hands it to the optimizer only inside step()
    (``_update_params_slice``). Rescaling ``p.grad`` before step() (as for fleet's optimizers) therefore
    misses the offloaded and the sliced gradients, which would step with the mean, not the sum. Scaling
    the loss before the reductions reaches every gradient alike, since the reductions are linear."""
    config = ctx.config
    if ctx.world_size > 1 and config is not None and uses_group_sharded(config):
        return float(ctx.data_world)
    return 1.0


def wrap_sharded_optimizer(optimizer: Any, ctx: ParallelCtx) -> Any:
    """fleet.distributed_optimizer (hybrid parallel, sharding stage 1) with the data-rank rescaling."""
    from paddle.distributed import fleet

    if ctx.config is not None and uses_group_sharded(ctx.config):
        raise UserError(
            "sharding stage 2/3 wraps model and optimizer together: use ctx.wrapping.wrap_model_and_optimizer"
        )
    fleet_optimizer = fleet.distributed_optimizer(optimizer)
    recorder = None
    if getattr(optimizer, "_grad_clip", None) is not None:
        from bmtrain_cli.parallel.grad_norm import install_recorder

        recorder = install_recorder(fleet_optimizer, ctx.expert_group)
    if ctx.expert_group is not None:  # expert parallel beside tensor or pipeline parallel
        from bmtrain_cli.parallel.expert_parallel import reduce_expert_gradients

        reduce_expert_gradients(fleet_optimizer, ctx.expert_group, ctx.data_world)
    return GradSumOptimizer(fleet_optimizer, ctx, recorder)


def group_sharded(model: Any, optimizer: Any, ctx: ParallelCtx, scaler: Any = None) -> Tuple[Any, Any, Any]:
    """Stage 2/3 (and offload) through paddle.distributed.sharding.group_sharded_parallel (GPU builds):
    (model, optimizer, scaler); an fp16 ``scaler`` comes back as Paddle's GroupShardedScaler."""
    config = ctx.config
    assert config is not None  # the config's sharding_stage chose group sharding
    if ctx.on_cpu:
        par = config.parallel
        raise UserError(
            f"sharding_stage {par.sharding_stage}"
            + (" with offload" if par.offload_optimizer or par.offload_params else "")
            + " needs a GPU build of Paddle (group_sharded_parallel supports only gpu, xpu and custom "
            "devices); on this machine use sharding_stage: 1"
        )
    from paddle.distributed.sharding import group_sharded_parallel

    kwargs = group_sharded_arguments(config)
    group = dp_group = None
    if ctx.hcg is not None:
        group = ctx.hcg.get_sharding_parallel_group()
        # data parallel x sharding: Paddle all-reduces the sharded gradients over the data-parallel group
        # only when it is given one (without it the data-parallel replicas would drift apart)
        if ctx.hcg.get_data_parallel_world_size() > 1:
            dp_group = ctx.hcg.get_data_parallel_group()
    model, optimizer, scaler = group_sharded_parallel(
        model, optimizer, scaler=scaler, group=group, dp_group=dp_group, **kwargs
    )
    # the sum over data ranks comes from the loss (backward_factor): the reduced gradients are not rescaled
    return model, GradSumOptimizer(optimizer, ctx, factor=1.0), scaler
