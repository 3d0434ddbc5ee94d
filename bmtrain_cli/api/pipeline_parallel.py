"""PipelineParallel: a Sequential (or a model's one LayerList) cut into a fleet PipelineLayer at the
boundaries of ``parallel.pipeline.partition``."""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from bmtrain_cli.api.common import (
    SPEC_ATTR,
    PipelineLoss,
    Spec,
    broadcast_parameters,
    has_parameters,
    spec_of,
    to_tensor,
)
from bmtrain_cli.api.distributed import context
from bmtrain_cli.errors import UserError

PARTITIONS = ("uniform", "parameters", "measured")


def pipeline_items(model: Any) -> List[Any]:
    """The ordered layers of a Sequential / LayerList, or of a model whose parameters all live in one
    LayerList child (its forward is taken to apply them in order)."""
    from paddle import nn

    if isinstance(model, (nn.Sequential, nn.LayerList)):
        return list(model.children())
    lists = [(n, c) for n, c in model.named_children() if isinstance(c, nn.LayerList)]
    outside = [n for n, c in model.named_children() if not isinstance(c, nn.LayerList) and has_parameters(c)]
    outside += list(model._parameters)
    if len(lists) == 1 and not outside:
        return list(lists[0][1].children())
    found = f"LayerList children {[n for n, _ in lists]}" if lists else "no LayerList child"
    extra = f", parameters outside it: {outside}" if outside else ""
    raise UserError(
        f"PipelineParallel needs a paddle.nn.Sequential, or a model whose parameters all live in one "
        f"paddle.nn.LayerList applied in order; {type(model).__name__} has {found}{extra}"
    )


def PipelineParallel(
    model: Any,
    stages: int = 2,
    loss_fn: Optional[Callable[[Any, Any], Any]] = None,
    micro_batches: Optional[int] = None,
    partition: str = "uniform",
    sample_input: Any = None,
) -> Any:
    """Cut ``model`` (a Sequential, or a model whose parameters live in one LayerList) into ``stages``
    pipeline stages (fleet PipelineLayer, 1F1B) and return fleet's pipeline wrapper holding this rank's
    stage. Boundaries by the partitioner of ``bmtrain train``: ``uniform`` (equal numbers of layers with
    parameters), ``parameters`` (balanced parameter counts) or ``measured`` (forward+backward time of
    every layer on ``sample_input``, rank 0's numbers). ``micro_batches`` (default: ``stages``) must divide
    each data rank's batch. ``loss_fn`` may also be given to train_step. With pipeline_parallel 1 the
    model is returned unchanged."""
    ctx = context("PipelineParallel")
    if stages != ctx.pp_degree:
        raise UserError(
            f"PipelineParallel(stages={stages}) but init_distributed set up pipeline_parallel={ctx.pp_degree}"
        )
    if partition not in PARTITIONS:
        raise UserError(f"PipelineParallel: partition {partition!r} is not one of {', '.join(PARTITIONS)}")
    if partition == "measured" and sample_input is None:
        raise UserError(
            "PipelineParallel(partition='measured') needs sample_input (a batch of the model's input)"
        )
    if micro_batches is not None and (
        isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1
    ):
        raise UserError(f"PipelineParallel: micro_batches must be a positive integer, got {micro_batches!r}")
    if spec_of(model).pipeline is not None:
        raise UserError("PipelineParallel: the model is already a pipeline")
    items = pipeline_items(model)
    if len(items) < stages:
        raise UserError(f"PipelineParallel: {len(items)} layer(s) cannot be cut into {stages} stages")
    spec_of(model).loss_fn = loss_fn
    if stages == 1:
        return model
    from paddle.distributed import fleet

    from bmtrain_cli.parallel import pipeline

    broadcast_parameters(model, ctx.hcg.get_pipe_parallel_group())
    if partition == "uniform":
        costs = [1.0 if has_parameters(item) else 0.0 for item in items]
    elif partition == "parameters":
        costs = pipeline.item_parameter_counts(items)
    else:
        costs = pipeline.measured_costs(items, to_tensor(sample_input))
    loss = PipelineLoss(loss_fn)
    layer = pipeline.cut_into_stages(items, costs, ctx, loss, partition)
    # fleet's pipeline reads the micro-batch count when it is built (its schedule and hooks are sized by
    # it); the micro-batch size follows each step's batch (train_step)
    fleet.fleet._user_defined_strategy.pipeline_configs = {
        "accumulate_steps": micro_batches or stages,
        "micro_batch_size": 1,
    }
    wrapped = fleet.distributed_model(layer)
    spec = Spec(tensor_parallel=spec_of(model).tensor_parallel, loss_fn=loss_fn, pipeline=loss)
    object.__setattr__(wrapped, SPEC_ATTR, spec)
    return wrapped
