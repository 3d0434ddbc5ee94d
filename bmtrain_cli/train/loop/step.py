"""One optimizer step: ``grad_accum_steps`` micro-batches per data rank, weighted over the whole step.

The step runs the recipe's objective (``parts.objective``, train/parts.py Objective): each micro-batch's
summed loss is divided by the step's denominator (SFT: the predicted tokens; DPO: the pairs), summed over
micro-batches and data ranks, before backward, so the gradient equals the single-process gradient of the
step's mean loss whatever the layout.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, List

from bmtrain_cli.errors import UserError
from bmtrain_cli.train.loop.stopping import TrainingStopped
from bmtrain_cli.train.loop.token_loss import count_tokens
from bmtrain_cli.train.monitoring.expert_load import add_loads, load_metrics
from bmtrain_cli.train.parts import Batch, ClipMeasuringStepper, Parts, StepOutput


class MicroBatches:
    """The micro-batches of each step, going round the loader's epochs (the loader keeps the position)."""

    def __init__(self, loader: Any, per_step: int) -> None:
        self.loader = loader
        self.per_step = per_step
        self._it: Iterator[Batch] = iter(loader)

    def next_step(self) -> List[Batch]:
        out = []
        for _ in range(self.per_step):
            try:
                out.append(next(self._it))
            except StopIteration:
                self._it = iter(self.loader)
                try:
                    out.append(next(self._it))
                except StopIteration:
                    raise UserError("the training data produced no batches") from None
        return out


def train_step(parts: Parts, step: int, micro: List[Batch]) -> StepOutput:
    """Forward and backward over ``micro``, gradient reduction, clipping, update (``step`` counts from 0)."""
    import paddle

    from bmtrain_cli.train.optimizer.adamw import clip_for_step, grad_norm_tensor

    ctx, optim = parts.ctx, parts.optim
    if ctx.pp_degree > 1:
        return pipeline_step(parts, step, micro)
    micro = [
        ctx.collectives.context_share(b) for b in micro
    ]  # context parallel: this rank's share of each row
    precision = optim.precision
    distributed = ctx.data_world > 1
    objective = parts.objective
    total_count, total_tokens = objective.begin_step(micro)
    denom = max(total_count, 1.0)
    grad_denom = denom / optim.backward_factor  # sharding stage 2/3: the sum over ranks via the loss
    lr = parts.schedule(step)
    optim.stepper.set_lr(lr)
    loss_acc = None
    aux_losses = []  # MoE with output_router_logits: each micro-batch's load-balancing loss (logged)
    loads = None  # MoE: each sparse layer's tokens per expert over the step (train/monitoring/expert_load.py)
    for b in micro:
        with precision.autocast():
            loss_sum, _ = objective.loss_sum(parts.model.wrapped, b)
        precision.backward(loss_sum / grad_denom)
        loss_acc = loss_sum.detach() if loss_acc is None else loss_acc + loss_sum.detach()
        aux = getattr(parts.model.raw, "last_aux_loss", None)
        if aux is not None:
            aux_losses.append(aux)
        loads = add_loads(loads, parts.model.raw)
    step_opt = optim.stepper
    if optim.own_clip and distributed and hasattr(step_opt, "reduce_gradients"):
        step_opt.reduce_gradients()  # plain data parallel: sum gradients now, step the inner one
        step_opt = optim.base
    precision.unscale(step_opt)
    # the loss and the fp32 global grad norm come to the host together: one sync per step
    norm_t = None
    if optim.own_clip and ctx.expert_group is not None:  # expert parallel: each expert counted once
        from bmtrain_cli.parallel.expert_parallel import global_grad_norm

        norm_t = global_grad_norm(ctx.expert_group, parts.model.params, grad_norm_tensor)
    elif optim.own_clip:
        norm_t = grad_norm_tensor(parts.model.params)
    assert loss_acc is not None  # a step has at least one micro-batch
    host_parts = [loss_acc.astype("float32").reshape([1])]
    if norm_t is not None:
        host_parts.append(norm_t.reshape([1]))
    host = paddle.concat(host_parts).numpy() if len(host_parts) > 1 else host_parts[0].numpy()
    loss = float(ctx.collectives.all_reduce_sum(float(host[0]))) / denom
    grad_norm = float(host[1]) if norm_t is not None else 0.0
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    max_norm = parts.config.train.max_grad_norm
    if finite and optim.own_clip and max_norm:  # a CpuAdamW folds the clip into its update
        clip_for_step(step_opt, parts.model.params, max_norm, grad_norm)
    applied = precision.step(step_opt, finite)
    overflow = precision.overflowed()  # fp16: the scaler skipped the update (found_inf over all ranks)
    applied = applied and not overflow
    if not optim.own_clip:
        grad_norm = fleet_grad_norm(parts, step, overflow)  # measured by fleet's clip inside step()
    # an fp16 overflow the scaler handled (update skipped, scale lowered) is a normal step, not a
    # non-finite one: overflows in the first steps are expected with dynamic scaling from 32768
    finite = math.isfinite(loss) and (math.isfinite(grad_norm) or overflow)
    optim.stepper.clear_grad(set_to_zero=False)
    metrics = dict(objective.step_metrics())
    if aux_losses:  # the mean over every micro-batch of the step (all data ranks), as one process logs it
        metrics["aux_loss"] = mean_over_ranks(ctx, float(paddle.add_n(aux_losses)), len(aux_losses))
    if loads is not None:
        metrics = {**metrics, **load_metrics(loads, parts.model.raw.arch.num_experts_per_tok)}
    return StepOutput(
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens=total_tokens,
        applied=applied,
        finite=finite,
        metrics=metrics,
    )


def pipeline_step(parts: Parts, step: int, micro: List[Batch]) -> StepOutput:
    """Pipeline parallel: 1F1B over the micro-batches and the optimizer step inside fleet; the loss on
    the last stage is the objective's pipeline loss, or fleet's token loss when it has none."""
    lr = parts.schedule(step)
    parts.optim.stepper.set_lr(lr)
    precision = parts.optim.precision
    loss_on_last = parts.objective.pipeline(parts.ctx, parts.config.train.micro_batch_size)
    # the forward and backward under autocast, as every other layout (train_batch runs its optimizer
    # step with autocast off itself); fp16 gives the scaler to train_batch, which scales each
    # micro-batch's loss and calls scaler.step/update
    with precision.autocast():
        loss_total, count = parts.ctx.wrapping.pipeline_step(
            parts.model.wrapped, micro, parts.optim.stepper, objective=loss_on_last, scaler=precision.scaler
        )
    # the ranks of a context group hold the same whole micro-batches here (the pipeline splits them)
    tokens = float(parts.ctx.collectives.all_reduce_sum(count_tokens(micro))) / parts.ctx.context_degree
    loss = loss_total / max(count, 1.0)
    overflow = precision.overflowed()
    grad_norm = fleet_grad_norm(parts, step, overflow)  # measured by fleet's clip inside train_batch
    metrics = loss_on_last.step_metrics() if loss_on_last is not None else {}
    aux = parts.ctx.wrapping.pipeline_aux_losses(parts.model.wrapped)  # on the last stage, or None
    if aux is not None:
        metrics = {**metrics, "aux_loss": mean_over_ranks(parts.ctx, *aux)}
    return StepOutput(
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        tokens=tokens,
        applied=not overflow,
        finite=math.isfinite(loss),
        metrics=metrics,
    )


def mean_over_ranks(ctx: Any, local_sum: float, local_count: float) -> float:
    """A per-micro-batch figure's mean over the step's micro-batches on every data rank (collective)."""
    import paddle

    total = ctx.collectives.all_reduce_sum(
        paddle.to_tensor([local_sum, local_count], dtype="float64")
    ).numpy()
    return float(total[0]) / max(float(total[1]), 1.0)


def fleet_grad_norm(parts: Parts, step: int, overflow: bool = False) -> float:
    """The global norm fleet's clip measured in the step just taken (nan if its clip did not run, or if
    the fp16 scaler found inf/nan: fleet's clip has no finite check and measures inf, while the update
    itself was skipped through found_inf, so the run goes on with a lower loss scale). Any other
    non-finite measured norm means the update already ran with it, inside fleet: stop rather than train
    on from non-finite weights."""
    stepper = parts.optim.stepper
    assert isinstance(stepper, ClipMeasuringStepper)  # own_clip is False only under fleet's wrapper
    norm = stepper.grad_norm()  # read (and forgotten) in every case
    if norm is None or overflow:
        return math.nan
    if not math.isfinite(norm):
        raise TrainingStopped(
            f"training stopped at step {step + 1}: the gradient norm is {norm} and fleet's optimizer "
            f"has applied the update; the last good checkpoint is kept in {parts.runtime.checkpoint_dir}. "
            "Lower learning_rate or check the data"
        )
    return norm
