"""``train_config.to_static``: the training forward (``loss_sum``) compiled with ``paddle.jit.to_static``.

The compiled program covers the model's forward and loss; Paddle runs its backward as one static program
too, and the optimizer step stays eager. Losses and gradients equal the dygraph path (tested to 1e-5).
Layouts whose forward goes through fleet's pipeline scheduler or tensor-parallel collectives are refused
with a clear message rather than silently running in dygraph.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import paddle

from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError


class LossSum(paddle.nn.Layer):
    """A layer whose forward is ``model.loss_sum`` (to_static compiles a Layer's forward)."""

    def __init__(self, model: paddle.nn.Layer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: paddle.Tensor,
        labels: paddle.Tensor,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
    ) -> Any:
        return self.model.loss_sum(
            input_ids, labels, attention_mask=attention_mask, position_ids=position_ids
        )


def check_to_static_supported(config: Config, ctx: Any = None) -> None:
    """Refuse the combinations where to_static cannot compile the step (UserError naming the fix)."""
    p = config.parallel
    tp = getattr(ctx, "tp_degree", p.tensor_parallel)
    pp = getattr(ctx, "pp_degree", p.pipeline_parallel)
    if pp > 1:
        raise UserError(
            "train_config.to_static cannot be combined with pipeline_parallel > 1: fleet's 1F1B scheduler "
            "runs each stage eagerly (set to_static: false, or pipeline_parallel: 1)"
        )
    if p.sharding_parallel > 1 and p.sharding_stage in (2, 3):
        raise UserError(
            "train_config.to_static cannot be combined with sharding_stage 2/3: the group-sharded wrapper "
            "gathers and releases parameters around an eager forward (set to_static: false, or "
            "sharding_stage: 1)"
        )
    if tp > 1:
        raise UserError(
            "train_config.to_static cannot be combined with tensor_parallel > 1: the tensor-parallel layers "
            "communicate inside the forward through eager collectives (set to_static: false, or "
            "tensor_parallel: 1)"
        )


def compile_loss_sum(model: paddle.nn.Layer) -> Callable[..., Any]:
    """``model.loss_sum`` compiled with paddle.jit.to_static (same signature, same results)."""
    return paddle.jit.to_static(LossSum(model))
