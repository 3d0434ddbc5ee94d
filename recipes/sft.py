"""The SFT recipe (train_config.stage: sft), read top to bottom: setup, step, loop, save.

    bmtrain train --config configs/quickstart.yaml            # runs recipe() below (stage: sft)
    python recipes/sft.py --config configs/quickstart.yaml    # the same (or a copy of this file you edited)
    bmtrain train --config C --recipe my_sft.py               # a copy, run by `bmtrain train` (or `bmtrain run`)
    python -m paddle.distributed.launch --nproc_per_node 2 recipes/sft.py --config C \
        --set parallel_config.data_parallel=2

setup() builds every part from bmtrain_cli.train, this method's own being the token data (SFT records,
train/setup.py token_data) and the token loss (train/loop/token_loss.py); it checks them all before the output
directory is touched (train/setup.py). train_step() is one optimizer step of the objective whatever the
parallel layout (train/loop/step.py), save() writes an atomic checkpoint (train/checkpoint/saving.py). To change how a
run trains, copy this file, edit it and point `bmtrain train --recipe` (or train_config.recipe) at it.
recipes/dpo.py builds its own data and objective and runs this file's loop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, TextIO, Tuple

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "bmtrain_cli").is_dir():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.data.stream import DataError
from bmtrain_cli.train.checkpoint.saving import save, save_if_new
from bmtrain_cli.train.evaluation.holdout import demo_accuracy, evaluate
from bmtrain_cli.train.loop.pipeline_rebalance import rebalance_if_due
from bmtrain_cli.train.loop.step import MicroBatches, train_step
from bmtrain_cli.train.loop.stopping import SignalGuard, bad_data_stop, signal_stop, too_many_nonfinite
from bmtrain_cli.train.loop.token_loss import token_loss
from bmtrain_cli.train.monitoring.report import StepMeter, hparams, opening_lines, print_report, summary
from bmtrain_cli.train.parts import Parts, StepOutput, TrainState
from bmtrain_cli.train.setup import TOKEN_DEMO, token_data
from bmtrain_cli.train.setup import setup as build_parts

OnStep = Callable[[Parts, TrainState, StepOutput], None]  # called after every step (tests, benchmarks)


def setup(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Tuple[Parts, TrainState]:
    """Every part of the run: SFT records as token data, the token loss as the objective (model,
    optimizer, parallel wrappers, schedule, resume, metrics: the shared setup of train/setup.py)."""
    return build_parts(
        loaded, demo=TOKEN_DEMO, build_data=token_data, build_objective=token_loss, stream=stream
    )


def before_training(parts: Parts, state: TrainState) -> None:
    """What is trained, and the demo task's held-out accuracy before the first step (kept on resume)."""
    for line in opening_lines(parts, parts.runtime.resume_from):
        parts.console.say(line)
    if parts.data.paths.get("heldout") and "accuracy_before" not in state.history:
        acc = demo_accuracy(parts)
        if acc is not None:
            state.history["accuracy_before"] = acc["accuracy"]
            parts.console.say(
                f"held-out accuracy before training: {100 * acc['accuracy']:.1f}% ({acc['n']} problems)"
            )


def loop(
    parts: Parts, state: TrainState, on_step: Optional[OnStep] = None
) -> Tuple[Parts, StepMeter, Path, Optional[float]]:
    """The loop, from ``state`` to ``total_steps``: (the parts as it leaves them, pipeline_rebalance
    having perhaps re-cut the stages; its meter; the last checkpoint; the final eval loss)."""
    t, rt, say = parts.config.train, parts.runtime, parts.console.say
    total = rt.total_steps
    batches = MicroBatches(parts.data.loader, rt.grad_accum_steps)
    meter = StepMeter(parts)
    # the final-loss window survives a resume (kept in the checkpoint's history)
    recent = [float(x) for x in state.history.get("recent_losses", [])]
    with SignalGuard() as guard:
        while state.step < total and guard.received is None:
            meter.start()
            try:
                micro = batches.next_step()
            except DataError as exc:  # streaming: a bad record ahead; the loader stays at this step
                raise bad_data_stop(str(exc), state.step, total, save_if_new(parts, state)) from None
            out = train_step(parts, state.step, micro)
            state.train_time += meter.stop(out)
            state.step += 1
            state.tokens_seen += int(out.tokens)
            if not out.finite:  # the update was skipped
                state.consecutive_nonfinite += 1
                state.skipped_steps += 1
                parts.metrics.log_event(
                    state.step, "nonfinite_skipped", loss=out.loss, grad_norm=out.grad_norm
                )
                say(
                    f"step {state.step}: non-finite loss/gradient (loss {out.loss}, grad norm {out.grad_norm}); "
                    f"update skipped ({state.consecutive_nonfinite} in a row)"
                )
                if state.consecutive_nonfinite >= t.max_nonfinite_steps:
                    raise too_many_nonfinite(
                        state.step, state.consecutive_nonfinite, t.max_nonfinite_steps, rt.checkpoint_dir
                    )
            else:
                state.consecutive_nonfinite = 0
                if not out.applied:  # fp16: the loss scaler found inf/nan gradients and skipped the update
                    state.skipped_steps += 1
                    parts.metrics.log_event(state.step, "loss_scale_overflow", loss=out.loss)
                recent = (recent + [out.loss])[-max(10, t.logging_steps) :]
                state.history["recent_losses"] = recent
                state.history["tokens_per_sec"] = meter.throughput[-1]
                parts.metrics.log_train(state.step, meter.values(out))
                if t.eval_steps and state.step % t.eval_steps == 0 and state.step < total:
                    evaluate(parts, state)
                if t.save_steps and state.step % t.save_steps == 0 and state.step < total:
                    save(parts, state)
                # pipeline_rebalance: times the stages; re-cuts them on a step just saved when unequal
                parts = rebalance_if_due(parts, state)
            if on_step is not None:
                on_step(parts, state, out)
        if guard.received is not None:  # SIGINT/SIGTERM: save the step reached, then stop
            raise signal_stop(guard.name or "signal", state.step, total, save_if_new(parts, state))
        final_eval = evaluate(parts, state)
        checkpoint = save_if_new(parts, state)
    return parts, meter, checkpoint, final_eval


def finish(
    parts: Parts,
    state: TrainState,
    meter: StepMeter,
    checkpoint: Path,
    final_eval: Optional[float],
    method_fields: Optional[Dict[str, Any]] = None,
    method_lines: Sequence[str] = (),
) -> Dict[str, Any]:
    """Held-out accuracy, loss curve, summary.json and the closing report (with a method's own
    figures: ``method_fields`` in summary.json, ``method_lines`` in the report)."""
    from bmtrain_cli.train.monitoring.metrics import plot_loss_curve, write_summary

    accuracy = demo_accuracy(parts)  # collective under tensor/pipeline parallel
    result = summary(parts, state, meter, checkpoint, final_eval, accuracy)
    result.update(method_fields or {})
    if parts.ctx.is_main:
        out = parts.runtime.output_dir
        png = plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png")
        result["plot"] = str(png) if png else None
        parts.metrics.add_hparams(
            hparams(parts), {"final_loss": result["final_loss"], "best_eval_loss": state.best_eval_loss}
        )
        parts.metrics.close()
        write_summary(out, result)
        print_report(parts, result, method_lines)
    return result


def train(parts: Parts, state: TrainState, on_step: Optional[OnStep] = None) -> Dict[str, Any]:
    """Before training, the loop, the summary; returns summary.json's content."""
    before_training(parts, state)
    parts, meter, checkpoint, final_eval = loop(parts, state, on_step)
    return finish(parts, state, meter, checkpoint, final_eval)


def recipe(
    loaded: LoadedConfig, stream: Optional[TextIO] = None, on_step: Optional[OnStep] = None
) -> Dict[str, Any]:
    """setup, then training; metrics are closed however it ends."""
    parts, state = setup(loaded, stream=stream)
    try:
        return train(parts, state, on_step)
    finally:
        parts.metrics.close()


if __name__ == "__main__":
    from bmtrain_cli.cli import run_recipe_script

    run_recipe_script(sys.modules[__name__])  # `bmtrain train --recipe THIS_FILE` with this file's arguments
