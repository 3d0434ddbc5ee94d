"""``train_config.to_static``: the training forward (``loss_sum``) compiled with ``paddle.jit.to_static``.

The compiled program covers the model's forward and loss; Paddle runs its backward as one static program
too, and the optimizer step stays eager. Losses and gradients equal the dygraph path (tested to 1e-5).
Layouts whose forward goes through fleet's pipeline scheduler or tensor-parallel collectives are refused
by config/checks.py (validate-config, and `bmtrain run` before launching) rather than run in dygraph.
"""

from __future__ import annotations

from typing import Any, Callable

import paddle

from bmtrain_cli.models.decoder import LossSum


def compile_loss_sum(model: paddle.nn.Layer) -> Callable[..., Any]:
    """``model.loss_sum`` compiled with paddle.jit.to_static (same signature, same results)."""
    return paddle.jit.to_static(LossSum(model))
