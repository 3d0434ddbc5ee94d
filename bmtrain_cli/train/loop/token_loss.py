"""The SFT objective (train/parts.py Objective): the token cross entropy, token-weighted over the step.

Each micro-batch's summed token loss is divided by the number of predicted tokens of the whole step
(summed over micro-batches and data ranks) before backward, so the gradient equals the single-process
gradient of the mean token loss whatever the layout. Under pipeline parallel fleet's schedule computes
the same loss itself (parallel/pipeline.py), so ``pipeline()`` is None.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.train.evaluation.holdout import whole_model
from bmtrain_cli.train.parts import (
    Batch,
    Console,
    ModelParts,
    OptimParts,
    Parts,
    PipelineLoss,
    TrainData,
    TrainState,
)
from bmtrain_cli.train.runtime import Runtime


def count_tokens(micro: List[Batch]) -> float:
    """Non-padding tokens of a step's micro-batches on this rank."""
    return float(sum(int((b["attention_mask"] > 0).sum()) for b in micro))


class TokenLoss:
    perplexity = True

    def __init__(
        self, loss_fn: Optional[Callable[..., Any]], ctx: ParallelCtx, keep_mask: bool = False
    ) -> None:
        self.loss_fn, self.ctx = loss_fn, ctx  # loss_fn: the training model's (compiled or sharded) loss_sum
        self.keep_mask = keep_mask  # the padding's attention mask for the load-balancing loss (to_tensors)

    def begin_step(self, micro: List[Batch]) -> Tuple[float, float]:
        """(predicted tokens, non-padding tokens) of the whole step, summed over the data ranks."""
        from bmtrain_cli.models.scoring import count_targets

        count = float(self.ctx.collectives.all_reduce_sum(float(sum(count_targets(b) for b in micro))))
        return count, float(self.ctx.collectives.all_reduce_sum(count_tokens(micro)))

    def loss_sum(self, model: Any, batch: Batch) -> Any:
        from bmtrain_cli.models.scoring import to_tensors

        assert self.loss_fn is not None  # None only under pipeline parallel, which never calls it
        return self.loss_fn(**to_tensors(batch, self.keep_mask))

    def step_metrics(self) -> Dict[str, float]:
        return {}

    def pipeline(self, ctx: ParallelCtx, micro_batch_size: int) -> Optional[PipelineLoss]:
        return None

    def evaluate(self, parts: Parts, state: TrainState) -> Tuple[float, Dict[str, Any]]:
        """Mean token loss over the eval set (collective; whole weights under tensor/pipeline parallel)."""
        from bmtrain_cli.models.scoring import eval_loss

        assert (
            parts.data.eval_loader is not None
        )  # train/evaluation/holdout.evaluate runs only with an eval set
        ctx = parts.ctx
        loss, _ = eval_loss(
            whole_model(parts),
            parts.data.eval_loader,
            parts.optim.precision.autocast,
            ctx.collectives.all_reduce_sum if ctx.data_world > 1 else None,
        )
        return loss, {}


def token_loss(
    rt: Runtime, data: TrainData, model: ModelParts, optim: OptimParts, ctx: ParallelCtx, console: Console
) -> TokenLoss:
    """The SFT recipe's objective (an ObjectiveBuilder of train/setup.py)."""
    from bmtrain_cli.models.moe import adds_aux_loss

    return TokenLoss(optim.loss_fn, ctx, adds_aux_loss(getattr(model.raw, "arch", None)))
