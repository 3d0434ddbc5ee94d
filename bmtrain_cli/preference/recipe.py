"""What the training recipe (recipes/train.py, train/*.py) calls for stage: dpo: the pair data, the
objective with its reference, the evaluation on preference pairs, and the summary's figures."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.preference.objective import PreferenceObjective


def build_data(
    data_config: Any, tokenizer: Any, ctx: ParallelCtx, has_eval: bool
) -> Tuple[Any, Optional[Any]]:
    """(training loader, eval loader or None) of this data rank."""
    from bmtrain_cli.preference.setup import build_loaders

    return build_loaders(data_config, tokenizer, ctx.data_rank, ctx.data_world, has_eval)


def build(config: Any, data: Any, model: Any, optim: Any, ctx: ParallelCtx, say: Any) -> PreferenceObjective:
    """The objective of train_config.dpo_loss over the built model and loaders (precomputes the reference
    log-probs when asked)."""
    from bmtrain_cli.preference.setup import build_objective

    precision = optim.precision
    return build_objective(
        config,
        model.raw,
        lora=model.lora is not None,
        factory=ctx.factory,
        dtype=precision.dtype if precision.master_weights else None,
        loaders=(data.loader, data.eval_loader),
        all_reduce=ctx.all_reduce_sum,
        is_main=ctx.is_main,
        say=say,
    )


def _scoring_model(parts: Any) -> Any:
    """The model pairs are scored with: the training model itself, tensor-parallel shards included; under
    pipeline parallel (collective) a gathered copy with the whole weights on every rank, as SFT's eval."""
    if parts.ctx.pp_degree > 1:
        return parts.ctx.gather_full_model(parts.model.wrapped, kernels=parts.config.model.kernels)
    return parts.model.wrapped


def evaluate(parts: Any, state: Any) -> Tuple[float, Dict[str, float]]:
    """Mean pair loss and TRL's metrics on the eval pairs (collective); the metrics go to
    state.history["eval_metrics"]."""
    loss, extra = parts.preference.evaluate(
        _scoring_model(parts), parts.data.eval_loader, parts.optim.precision.autocast
    )
    state.history["eval_metrics"] = extra
    return loss, extra


def before_training(parts: Any, state: Any) -> None:
    """The held-out preference figures before the first step (kept across a resume)."""
    if parts.preference is None or parts.data.eval_loader is None or "eval_before" in state.history:
        return
    _, before = parts.preference.evaluate(
        _scoring_model(parts), parts.data.eval_loader, parts.optim.precision.autocast
    )
    state.history["eval_before"] = before
    parts.console.say(
        f"held-out preference accuracy before training: {100 * before['preference_accuracy']:.1f}%"
    )


def summary_fields(parts: Any, state: Any) -> Dict[str, Any]:
    """TRL's metrics of the last step, of the last eval (eval_*) and before training (before_eval_*)."""
    if parts.preference is None:
        return {}
    out: Dict[str, Any] = dict(parts.preference.last_metrics)
    out.update({f"eval_{k}": v for k, v in state.history.get("eval_metrics", {}).items()})
    out.update({f"before_eval_{k}": v for k, v in state.history.get("eval_before", {}).items()})
    return out


def report_line(s: Dict[str, Any]) -> Optional[str]:
    if s.get("eval_preference_accuracy") is None:
        return None
    before = s.get("before_eval_preference_accuracy")
    before_txt = f"{100 * before:.1f}%" if before is not None else "?"
    return f"  held-out preference accuracy: before {before_txt} -> after {100 * s['eval_preference_accuracy']:.1f}%"
