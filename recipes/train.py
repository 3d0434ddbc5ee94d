"""The training recipe behind `bmtrain train`: setup, step, loop, save, read top to bottom.

    bmtrain train --config configs/quickstart.yaml            # runs recipe() below
    python recipes/train.py --config configs/quickstart.yaml  # the same (or a copy of this file you edited)
    python -m paddle.distributed.launch --nproc_per_node 2 recipes/train.py --config C \
        --set parallel_config.data_parallel=2

Every part comes from bmtrain_cli.train: setup() builds and checks them all before the output directory
is touched (train/setup.py), train_step() is one optimizer step whatever the parallel layout
(train/step.py), save() writes an atomic checkpoint (train/saving.py). To change how a run trains, copy
this file and edit the loop.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, Optional, TextIO

if __name__ == "__main__" and (Path(__file__).resolve().parents[1] / "bmtrain_cli").is_dir():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.data.stream import DataError
from bmtrain_cli.parallel.rebalance import rebalance_if_due
from bmtrain_cli.preference.recipe import before_training
from bmtrain_cli.train.holdout import demo_accuracy, evaluate
from bmtrain_cli.train.parts import Parts, StepOutput, TrainState
from bmtrain_cli.train.report import StepMeter, hparams, opening_lines, print_report, summary
from bmtrain_cli.train.saving import save, save_if_new
from bmtrain_cli.train.setup import setup
from bmtrain_cli.train.step import MicroBatches, train_step
from bmtrain_cli.train.stopping import SignalGuard, bad_data_stop, signal_stop, too_many_nonfinite

OnStep = Callable[[Parts, TrainState, StepOutput], None]  # called after every step (tests, benchmarks)


def train(parts: Parts, state: TrainState, on_step: Optional[OnStep] = None) -> Dict[str, Any]:
    """The loop, from ``state`` to ``total_steps``; returns summary.json's content."""
    t, rt, say = parts.config.train, parts.runtime, parts.console.say
    total = rt.total_steps
    for line in opening_lines(parts, rt.resume_from):
        say(line)
    if parts.data.paths.get("heldout") and "accuracy_before" not in state.history:
        acc = demo_accuracy(parts)
        if acc is not None:
            state.history["accuracy_before"] = acc["accuracy"]
            say(f"held-out accuracy before training: {100 * acc['accuracy']:.1f}% ({acc['n']} problems)")
    before_training(parts, state)  # stage dpo: held-out preference accuracy

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
    return finish(parts, state, meter, checkpoint, final_eval)


def finish(
    parts: Parts, state: TrainState, meter: StepMeter, checkpoint: Path, final_eval: Optional[float]
) -> Dict[str, Any]:
    """Held-out accuracy, loss curve, summary.json and the closing report."""
    from bmtrain_cli.train.metrics import plot_loss_curve, write_summary

    accuracy = demo_accuracy(parts)  # collective under tensor/pipeline parallel
    result = summary(parts, state, meter, checkpoint, final_eval, accuracy)
    if parts.ctx.is_main:
        out = parts.runtime.output_dir
        png = plot_loss_curve(out / "metrics.jsonl", out / "loss_curve.png")
        result["plot"] = str(png) if png else None
        parts.metrics.add_hparams(
            hparams(parts), {"final_loss": result["final_loss"], "best_eval_loss": state.best_eval_loss}
        )
        parts.metrics.close()
        write_summary(out, result)
        print_report(parts, result)
    return result


def recipe(
    loaded: LoadedConfig, stream: Optional[TextIO] = None, on_step: Optional[OnStep] = None
) -> Dict[str, Any]:
    """setup, then the loop; metrics are closed however it ends."""
    parts, state = setup(loaded, stream=stream)
    try:
        return train(parts, state, on_step)
    finally:
        parts.metrics.close()


if __name__ == "__main__":
    from bmtrain_cli.cli import main

    sys.modules["bmtrain_recipe_train"] = sys.modules[__name__]  # `train` below runs this file's recipe
    main(["train", *sys.argv[1:]])
