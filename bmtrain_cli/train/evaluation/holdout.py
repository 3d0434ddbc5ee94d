"""Evaluation during training: the eval loss and the demo task's held-out answer accuracy."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from bmtrain_cli.train.parts import Parts, TrainState


def gather_sharded_parameters(parts: Parts) -> None:
    """Sharding stage 3 keeps only a slice of each parameter on a rank: gather them whole (collective)
    before weights are read for a checkpoint or an evaluation."""
    gather = getattr(parts.optim.sharded, "get_all_parameters", None)
    if gather is not None:
        gather()


def whole_model(parts: Parts) -> Any:
    """The model with whole weights: the raw model, or (collective) a gathered copy under tp/pp/ep > 1."""
    gather_sharded_parameters(parts)
    if not parts.ctx.holds_whole_weights:
        return parts.ctx.wrapping.gather_full_model(parts.model.wrapped, kernels=parts.config.model.kernels)
    return parts.model.raw


def evaluate(parts: Parts, state: TrainState) -> Optional[float]:
    """The objective's eval loss over the eval set (collective); updates the best one and logs it."""
    if parts.data.eval_loader is None:
        return None
    loss, extra = parts.objective.evaluate(parts, state)
    if math.isfinite(loss) and (state.best_eval_loss is None or loss < state.best_eval_loss):
        state.best_eval_loss = loss
    parts.metrics.log_eval(state.step, loss, extra, nll=parts.objective.perplexity)
    return loss


def demo_accuracy(parts: Parts) -> Optional[Dict[str, Any]]:
    """Held-out answer accuracy of the demo task (None for other data, and on ranks other than 0)."""
    heldout = parts.data.paths.get("heldout")
    if not heldout:
        return None
    model = whole_model(parts)  # collective under tensor/pipeline parallel
    if not parts.ctx.is_main:
        return None
    from bmtrain_cli.data.readers import read_values
    from bmtrain_cli.train.evaluation.answer_accuracy import answer_accuracy

    t = parts.config.train
    return answer_accuracy(
        model, parts.tokenizer, read_values(heldout), template=t.template, data_format=t.data_format
    )
