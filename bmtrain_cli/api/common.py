"""What the API's wrappers record on a model and an optimizer, and the helpers they share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

from bmtrain_cli.errors import UserError

SPEC_ATTR = "_bmtrain_parallel"  # the wrappers applied to a model (a Spec)
WRAPPED_ATTR = "_bmtrain_wrapped"  # an optimizer's gradient-reducing wrapper, built on first use


@dataclass
class Spec:
    tensor_parallel: bool = False
    loss_fn: Optional[Callable[[Any, Any], Any]] = None  # PipelineParallel's, used when train_step gets None
    pipeline: Optional[PipelineLoss] = None  # the pipeline's loss hook when PipelineParallel cut the model


def spec_of(model: Any) -> Spec:
    spec = getattr(model, SPEC_ATTR, None)
    if spec is None:
        spec = Spec()
        object.__setattr__(model, SPEC_ATTR, spec)
    return spec


def broadcast_parameters(model: Any, group: Any) -> None:
    """Every rank of ``group`` takes the group's first rank's parameters."""
    import paddle
    import paddle.distributed as dist

    with paddle.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=group.ranks[0], group=group)


def linear_types() -> Tuple[Any, Any]:
    from paddle import nn

    return nn.Linear, nn.Embedding


def has_parameters(layer: Any) -> bool:
    return any(True for _ in layer.parameters())


def to_tensor(value: Any) -> Any:
    import paddle

    return value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)


def scalar_loss(loss: Any) -> Any:
    import paddle

    if not isinstance(loss, paddle.Tensor) or int(loss.size) != 1:
        raise UserError("train_step: loss_fn must return a one-element Tensor (the mean over the batch rows)")
    return loss.reshape([])


class PipelineLoss:
    """The last stage's loss for fleet's train_batch. Fleet divides each micro-batch's loss by the number
    of micro-batches and averages gradients over the data ranks; ``scale`` (set per step by train_step)
    undoes both and weights the micro-batch by its share of the global batch."""

    def __init__(self, loss_fn: Optional[Callable[[Any, Any], Any]]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0
        self.row_sums: List[float] = []

    def __call__(self, output: Any, labels: Any) -> Any:
        assert self.loss_fn is not None  # train_step sets it before fleet's train_batch calls this
        loss = scalar_loss(self.loss_fn(output, labels))
        rows = int(labels.shape[0])
        self.row_sums.append(float(loss) * rows)
        return loss * (rows * self.scale)
