"""Layer factory: the decoder asks this object for its linear, embedding and LM-head layers, so that
tensor parallelism (bmtrain_cli/parallel/layers.py: TensorParallelFactory) can swap them without any
change to the model code. The plain factory builds ordinary single-device Paddle layers."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Tuple

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.ops import reference


class LayerFactory(Protocol):
    """What the model builder asks for its layers (PlainFactory here; parallel/layers.py's
    TensorParallelFactory splits them over the model-parallel group)."""

    tp_degree: int  # ranks a split layer is spread over (1: nothing is split)
    tp_rank: int  # this rank's shard
    mp_group: Any  # fleet's model-parallel group (None: single device)

    def linear(self, in_f: int, out_f: int, bias: bool, tp: Optional[str] = None) -> nn.Layer: ...

    def embedding(self, vocab: int, hidden: int) -> nn.Layer: ...

    def lm_head(self, hidden: int, vocab: int) -> nn.Layer: ...

    def head_matmul(
        self, hidden: paddle.Tensor, weight: paddle.Tensor, transposed: bool
    ) -> paddle.Tensor: ...

    def vocab_cross_entropy_sum(
        self, logits: paddle.Tensor, labels: paddle.Tensor
    ) -> Tuple[paddle.Tensor, paddle.Tensor]: ...

    def whole_vocab(self, logits: paddle.Tensor) -> paddle.Tensor: ...

    def linear_kind(self, layer: nn.Layer) -> Optional[str]: ...

    def group_max(self, values: np.ndarray) -> np.ndarray: ...

    def quantized_linear(
        self, layer: nn.Layer, q: Any, bias: Optional[paddle.Tensor], dtype: str, impl: str
    ) -> nn.Layer: ...

    def vocab_reduce(self, value: paddle.Tensor, op: str) -> paddle.Tensor: ...

    @property
    def sum_grad_over_group(self) -> Optional[Callable[[paddle.Tensor], paddle.Tensor]]:
        """A hook that sums a replicated weight's gradient over the group (None: one device)."""


class PlainFactory:
    """Single-device layers. ``tp`` ("column" / "row") is accepted and ignored."""

    tp_degree: int = 1
    tp_rank: int = 0
    mp_group: Any = None
    sum_grad_over_group: Optional[Callable[[paddle.Tensor], paddle.Tensor]] = None

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

    def whole_vocab(self, logits: paddle.Tensor) -> paddle.Tensor:
        """The logits over the whole vocabulary (they are already)."""
        return logits

    def vocab_reduce(self, value: paddle.Tensor, op: str) -> paddle.Tensor:
        """A per-row reduction ("max" or "sum") of the vocabulary shards: the value itself on one device."""
        return value

    def linear_kind(self, layer: nn.Layer) -> Optional[str]:
        """How a layer this factory made holds a linear weight: "whole" (an nn.Linear), None for any other
        layer (the quantised base's targets, bmtrain_cli/quant/layer.py)."""
        return "whole" if isinstance(layer, nn.Linear) else None

    def group_max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum over the ranks sharing a split layer: the values on one device."""
        return values

    def quantized_linear(
        self, layer: nn.Layer, q: Any, bias: Optional[paddle.Tensor], dtype: str, impl: str
    ) -> nn.Layer:
        """The quantised layer standing for ``layer``: its weight as ``q`` (quant/formats.QuantizedWeight)."""
        from bmtrain_cli.quant.layer import QuantLinear

        return QuantLinear(q, bias, dtype, impl)
