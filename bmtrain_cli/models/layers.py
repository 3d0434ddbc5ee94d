"""Layer factory: the decoder asks this object for its linear, embedding and LM-head layers, so that
tensor parallelism (bmtrain_cli/parallel/layers.py: TensorParallelFactory) can swap them without any
change to the model code. The plain factory builds ordinary single-device Paddle layers."""

from __future__ import annotations

from typing import Optional, Tuple

import paddle
from paddle import nn

from bmtrain_cli.ops import reference


class PlainFactory:
    """Single-device layers. ``tp`` ("column" / "row") is accepted and ignored."""

    tp_degree: int = 1

    def linear(self, in_f: int, out_f: int, bias: bool, tp: Optional[str] = None) -> nn.Layer:
        """A Linear with weight [in_f, out_f] (Paddle layout) and an optional bias."""
        return nn.Linear(in_f, out_f, bias_attr=None if bias else False)

    def embedding(self, vocab: int, hidden: int) -> nn.Layer:
        return nn.Embedding(vocab, hidden)

    def lm_head(self, hidden: int, vocab: int) -> nn.Layer:
        return nn.Linear(hidden, vocab, bias_attr=False)

    def head_matmul(self, hidden: paddle.Tensor, weight: paddle.Tensor, transposed: bool) -> paddle.Tensor:
        """Logits from a head weight the model holds itself (tied embedding, normalised head)."""
        return paddle.matmul(hidden, weight, transpose_y=transposed)

    def vocab_cross_entropy_sum(
        self, logits: paddle.Tensor, labels: paddle.Tensor
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(sum of token losses, number of non-ignored labels) over logits [..., vocab]."""
        return reference.cross_entropy_sum(logits, labels)
