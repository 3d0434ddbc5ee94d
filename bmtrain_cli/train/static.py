"""``train_config.to_static``: the training forward (``loss_sum``) compiled with ``paddle.jit.to_static``.

The compiled program covers the model's forward and loss; Paddle runs its backward as one static program
too, and the optimizer step stays eager. Losses and gradients equal the dygraph path (tested to 1e-5).
Layouts whose forward goes through fleet's pipeline scheduler or tensor-parallel collectives are refused
by config/checks.py (validate-config, and `bmtrain run` before launching) rather than run in dygraph.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import paddle


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


def compile_loss_sum(model: paddle.nn.Layer) -> Callable[..., Any]:
    """``model.loss_sum`` compiled with paddle.jit.to_static (same signature, same results)."""
    return paddle.jit.to_static(LossSum(model))
