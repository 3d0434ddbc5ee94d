"""train_step: one optimizer step on a wrapped model, gradients reduced through
``ParallelContext.wrapping.wrap_optimizer`` (see the package docstring for the loss convention)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from bmtrain_cli.api.common import SPEC_ATTR, WRAPPED_ATTR, PipelineLoss, Spec, scalar_loss, to_tensor
from bmtrain_cli.api.distributed import context
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import ParallelCtx


def _optimizer_for(ctx: ParallelCtx, model: Any, optimizer: Any) -> Any:
    """The optimizer wrapper that reduces gradients for this layout (built once per optimizer)."""
    wrapped = getattr(optimizer, WRAPPED_ATTR, None)
    if wrapped is not None:
        return wrapped
    if not hasattr(optimizer, "_parameter_list"):
        raise UserError("train_step: optimizer must be a paddle.optimizer.Optimizer")
    mine = {id(p) for p in optimizer._parameter_list or []}
    missing = [n for n, p in model.named_parameters() if not p.stop_gradient and id(p) not in mine]
    if missing:
        raise UserError(
            f"train_step: the optimizer does not hold the model's parameters ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); build it after the wrappers, over model.parameters()"
        )
    from paddle.nn import ClipGradByNorm

    if ctx.tp_degree > 1 and isinstance(getattr(optimizer, "_grad_clip", None), ClipGradByNorm):
        raise UserError(
            "train_step: ClipGradByNorm clips each tensor by its own norm, which under tensor parallel is a "
            "shard's norm; use paddle.nn.ClipGradByGlobalNorm (exact under every layout)"
        )
    wrapped = ctx.wrapping.wrap_optimizer(optimizer)
    setattr(optimizer, WRAPPED_ATTR, wrapped)
    return wrapped


def train_step(
    model: Any, batch: Tuple[Any, Any], loss_fn: Optional[Callable[[Any, Any], Any]], optimizer: Any
) -> float:
    """One optimizer step: forward, backward, gradient reduction over the data ranks, the optimizer's
    clip (if it has a grad_clip) and update; gradients are cleared afterwards.

    ``batch = (inputs, labels)`` is this data rank's slice of the global batch (the tensor and pipeline
    ranks of one data rank pass the same slice); ``model(inputs)`` is the output. ``loss_fn(output,
    labels)`` returns the mean over the rows of ``labels``. Returns the mean loss over the whole global
    batch, the same number on every rank."""
    ctx = context("train_step")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UserError("train_step: batch must be (inputs, labels)")
    spec = getattr(model, SPEC_ATTR, None) or Spec()
    if ctx.pp_degree > 1 and spec.pipeline is None:
        raise UserError(
            f"train_step: init_distributed set up pipeline_parallel={ctx.pp_degree}; wrap the model with "
            f"PipelineParallel(model, stages={ctx.pp_degree})"
        )
    if ctx.tp_degree > 1 and not spec.tensor_parallel:
        raise UserError(
            f"train_step: init_distributed set up tensor_parallel={ctx.tp_degree}; wrap the model with "
            "TensorParallel(model) before building the optimizer"
        )
    loss_fn = loss_fn or spec.loss_fn
    if loss_fn is None:
        raise UserError("train_step: no loss_fn (pass one here or to PipelineParallel)")
    inputs, labels = (to_tensor(x) for x in batch)
    rows = int(labels.shape[0])
    total_rows = ctx.collectives.all_reduce_sum(float(rows))
    wrapped = _optimizer_for(ctx, model, optimizer)
    ctx.collectives.mark_progress()
    if spec.pipeline is not None:
        return _pipeline_step(ctx, model, spec.pipeline, inputs, labels, loss_fn, wrapped, total_rows)
    loss = scalar_loss(loss_fn(model(inputs), labels))
    (loss * (rows / total_rows)).backward()
    wrapped.step()
    wrapped.clear_grad()
    return ctx.collectives.all_reduce_sum(float(loss) * rows) / total_rows


def _pipeline_step(
    ctx: ParallelCtx,
    model: Any,
    hook: PipelineLoss,
    inputs: Any,
    labels: Any,
    loss_fn: Callable[[Any, Any], Any],
    wrapped: Any,
    total_rows: float,
) -> float:
    from bmtrain_cli.parallel.pipeline import from_last_stage
    from bmtrain_cli.parallel.sharding import GradSumOptimizer

    rows, micro = int(labels.shape[0]), int(model.accumulate_steps)
    if rows % micro:
        raise UserError(
            f"train_step: this data rank's batch of {rows} rows does not split into {micro} pipeline "
            "micro-batches (PipelineParallel's micro_batches)"
        )
    model.micro_batch_size = rows // micro
    hook.loss_fn, hook.row_sums = loss_fn, []
    hook.scale = micro * ctx.data_world / total_rows
    inputs.stop_gradient = True
    # train_batch wants fleet's own optimizer; the data-rank averaging is undone by ``scale`` instead
    inner = wrapped._inner if isinstance(wrapped, GradSumOptimizer) else wrapped
    model.train_batch([inputs, labels], inner)
    local = sum(hook.row_sums)
    return ctx.collectives.all_reduce_sum(from_last_stage(ctx, local)) / total_rows
