"""Saving a training run's checkpoint and resuming from one (the layout itself: train/checkpoint.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import yaml

from bmtrain_cli.checkpoint_layout import step_name
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.train.evaluation.holdout import gather_sharded_parameters
from bmtrain_cli.train.loop.stopping import TrainingStopped
from bmtrain_cli.train.parts import Console, ModelParts, OptimParts, Parts, TrainData, TrainState


def check_weights_finite(parts: Parts, step: int) -> None:
    """A checkpoint never holds inf or NaN weights, and a run that made them never reports success.
    Collective (every rank checks its own parameters; the verdict is summed over all ranks)."""
    import paddle

    checks = [paddle.isfinite(q).all() for q in parts.model.raw.parameters()]
    finite = bool(paddle.stack(checks).all()) if checks else True  # one device-to-host sync
    bad = paddle.to_tensor(0.0 if finite else 1.0)
    if parts.ctx.world_size > 1:
        import paddle.distributed as dist

        dist.all_reduce(bad)
    if float(bad) > 0:
        raise TrainingStopped(
            f"training stopped at step {step}: the weights hold inf or NaN (the updates diverged: "
            "lower learning_rate or check the data); they were not saved, the last good checkpoint is "
            f"kept in {parts.runtime.checkpoint_dir}",
            exit_code=2,
        )


def _run_state(parts: Parts, state: TrainState) -> Dict[str, Any]:
    """trainer_state.json's content beside the step: what a resume needs and export reads."""
    paths = parts.data.paths
    eval_path = paths.get("eval")
    if isinstance(eval_path, list):
        eval_path = eval_path[0] if eval_path else None
    return {
        # export compares eval loss before/after on the file this run evaluated on
        "eval_data_path": str(Path(eval_path).resolve()) if isinstance(eval_path, str) else None,
        "data_paths": {k: v for k, v in paths.items() if v is not None},
        "scaler": parts.optim.precision.state_dict(),
        "data": parts.data.loader.state_dict(),
        "schedule": parts.schedule.state_dict(),
        "counters": state.counters(),
        "history": state.history,
        "total_steps": parts.runtime.total_steps,
    }


def save(parts: Parts, state: TrainState) -> Path:
    """Checkpoint step-<state.step> (collective: every rank calls it)."""
    from bmtrain_cli.train.checkpoint.optimizer_state import optimizer_layout, write_optimizer_shard
    from bmtrain_cli.train.checkpoint.training_state import save_checkpoint

    ctx, rt, optim, model = parts.ctx, parts.runtime, parts.optim, parts.model
    check_weights_finite(parts, state.step)
    run_state = _run_state(parts, state)
    path = rt.checkpoint_dir / step_name(state.step)
    gather_sharded_parameters(parts)
    layout = optimizer_layout(ctx)
    if not layout["portable"]:
        # the optimizer state is split over the ranks: every rank saves its part (reused by a resume
        # under the same layout only); rank 0 moves them into the checkpoint after the barrier
        write_optimizer_shard(rt.checkpoint_dir, state.step, ctx.rank, optim.base, model.raw)
        ctx.collectives.barrier()
    # LoRA: adapters only (+ base path and hash); gathering them is collective under tensor parallel
    writer = model.lora.weights_writer(model.wrapped, ctx) if model.lora is not None else None
    if writer is None:
        # collective: under tensor/pipeline parallel gather whole tensors (None: the default writer)
        writer = ctx.wrapping.checkpoint_weights_writer(model.wrapped)
    if ctx.is_main:
        path = save_checkpoint(
            rt.checkpoint_dir,
            state.step,
            model=model.raw,
            optimizer=optim.base,
            state=run_state,
            tokenizer=parts.tokenizer,
            keep=parts.config.train.save_total_limit,
            weights_writer=writer,
            extra_files={"bmtrain_config.yaml": yaml.safe_dump(parts.config.to_dict(), sort_keys=False)},
            layout=layout,
        )
        parts.metrics.log_event(state.step, "checkpoint", path=str(path))
    ctx.collectives.barrier()
    state.last_saved_step = state.step
    state.last_checkpoint = path
    return path


def save_if_new(parts: Parts, state: TrainState) -> Path:
    """The checkpoint of the current step: saved now unless it already was."""
    if state.last_saved_step == state.step and state.last_checkpoint is not None:
        return state.last_checkpoint
    return save(parts, state)


def restore(
    ckpt: Path, ctx: ParallelCtx, console: Console, data: TrainData, model: ModelParts, optim: OptimParts
) -> TrainState:
    """Load checkpoint ``ckpt`` into the built parts (weights, optimizer, loss scale, data position) and
    return the state the run continues from."""
    from bmtrain_cli.train.checkpoint.optimizer_state import optimizer_layout
    from bmtrain_cli.train.checkpoint.training_state import load_training_state

    saved = load_training_state(
        ckpt, model=model.raw, optimizer=optim.base, layout=optimizer_layout(ctx), rank=ctx.rank
    )
    if not saved.get("optimizer_restored", True):
        console.say(f"note: {saved['optimizer_message']} (weights, schedule and data position are resumed)")
    for note in saved.get("rng_notes") or []:
        console.say(f"note: {note}")
    if hasattr(optim.base, "sync_from_model"):
        optim.base.sync_from_model()
    optim.precision.load_state_dict(saved.get("scaler") or {})
    if saved.get("data") is not None:
        data.loader.load_state_dict(saved["data"])
    return TrainState.restored(ckpt, int(saved["step"]), saved.get("counters", {}), saved.get("history", {}))
