"""Tensor-parallel layer factory: the same methods as models.layers.PlainFactory over fleet's mp layers.

The decoder asks the factory for every projection; with this factory the q/k/v/gate/up projections are
column-parallel (output features split), o/down row-parallel (input features split, output all-reduced),
the embedding and the LM head are split over the vocabulary, and the loss is fleet's
ParallelCrossEntropy over the vocabulary shards. Model code does not change.

Every split parameter carries fleet's ``is_distributed`` and ``split_axis`` attributes; the context's
``full_state_dict``/``load_full_state_dict`` use them to gather and split checkpoints, so saved weights are
always whole tensors.

A quantised base (QLoRA, bmtrain_cli/quant/): each rank quantises its own shard of a column- or
row-parallel weight into a :class:`ShardedQuantLinear`, which runs the same collectives as fleet's layer
around the quantised product. validate-config admits only block sizes whose blocks do not straddle a shard
boundary (quant/formats.shard_mismatch), so the shards' codes are those of the whole weight.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.quant.formats import QuantizedWeight, shard_mismatch
from bmtrain_cli.quant.layer import QuantLinear


class ShardedQuantLinear(QuantLinear):
    """This rank's quantised shard of a column-parallel (output features split, input replicated) or
    row-parallel (input features split, output all-reduced, whole bias added after) linear layer. It
    carries fleet's attributes (``world_size``, ``is_mp``, ``model_parallel_group``, ``rank``) and the
    shard's ``split_axis`` in Paddle's [in, out] layout, which LoRA's wrapper and the weight gathering read."""

    def __init__(
        self, q: QuantizedWeight, bias: Any, dtype: str, impl: str, kind: str, factory: TensorParallelFactory
    ) -> None:
        super().__init__(q, bias, dtype, impl)
        self.tp_kind = kind
        self.split_axis = 1 if kind == "column" else 0
        self.world_size, self.rank, self.is_mp = factory.tp_degree, factory.tp_rank, True
        self.model_parallel_group = factory.mp_group

    def forward(self, x: Any) -> Any:
        from paddle.distributed.fleet.layers.mpu import mp_ops

        group = self.model_parallel_group
        if self.tp_kind == "column":
            y = self.product(mp_ops._c_identity(x, group=group))
        else:
            y = mp_ops._mp_allreduce(
                self.product(x), group=group, use_calc_stream=True, use_model_parallel=True
            )
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.tp_kind}-parallel shard {self.rank}/{self.world_size}"


class TensorParallelFactory:
    """Builds layers split over the model-parallel group of fleet's hybrid topology."""

    def __init__(self, tp_degree: int, tp_rank: int, mp_group: Any = None) -> None:
        self.tp_degree = tp_degree
        self.tp_rank = tp_rank
        self.mp_group = mp_group

    def _check_divisible(self, what: str, n: int) -> None:
        if n % self.tp_degree:
            raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel ({self.tp_degree})")

    def linear(self, in_f: int, out_f: int, bias: bool = False, tp: Optional[str] = None) -> Any:
        import paddle
        from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

        if tp is None:
            return paddle.nn.Linear(in_f, out_f, bias_attr=None if bias else False)
        if tp == "column":
            self._check_divisible("output features", out_f)
            return ColumnParallelLinear(
                in_f, out_f, has_bias=bias, gather_output=False, mp_group=self.mp_group
            )
        if tp == "row":
            self._check_divisible("input features", in_f)
            return RowParallelLinear(
                in_f, out_f, has_bias=bias, input_is_parallel=True, mp_group=self.mp_group
            )
        raise ValueError(f"unknown tensor-parallel kind {tp!r} (expected None, 'column' or 'row')")

    def embedding(self, vocab: int, hidden: int) -> Any:
        from paddle.distributed.fleet.meta_parallel import VocabParallelEmbedding

        self._check_divisible("vocab_size", vocab)
        return VocabParallelEmbedding(vocab, hidden, mp_group=self.mp_group)

    def lm_head(self, hidden: int, vocab: int) -> Any:
        """Output projection whose logits stay split over the vocabulary ([b, s, vocab / tp])."""
        from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear

        self._check_divisible("vocab_size", vocab)
        return ColumnParallelLinear(
            hidden, vocab, has_bias=False, gather_output=False, mp_group=self.mp_group
        )

    def head_matmul(self, hidden: Any, weight: Any, transposed: bool) -> Any:
        """Vocabulary-split logits from a head weight the model holds itself (the tied, vocabulary-split
        embedding, or a normalised head). The hidden state is replicated over the group, so its gradient
        is the SUM of every shard's contribution: fleet's identity op (all-reduce in backward) supplies it,
        as ColumnParallelLinear does for an untied head."""
        import paddle
        from paddle.distributed.fleet.layers.mpu import mp_ops

        hidden = mp_ops._c_identity(hidden, group=self.mp_group)
        return paddle.matmul(hidden, weight, transpose_y=transposed)

    def sum_grad_over_group(self, weight: Any) -> Any:
        """The weight itself in forward; in backward its gradient is summed over the group. For a
        replicated weight that each rank applies to its own shard of the activations (Qwen3's per-head
        q/k norm over this rank's heads): every rank's copy then gets the whole gradient and stays equal."""
        from paddle.distributed.fleet.layers.mpu import mp_ops

        return mp_ops._c_identity(weight, group=self.mp_group)

    def vocab_cross_entropy_sum(self, logits: Any, labels: Any, ignore_index: int = -100) -> Tuple[Any, Any]:
        """(sum of token losses, number of non-ignored tokens) for vocabulary-split logits."""
        from paddle.distributed.fleet.meta_parallel import ParallelCrossEntropy

        loss_fn = ParallelCrossEntropy(mp_group=self.mp_group, ignore_index=ignore_index)
        flat_logits = logits.reshape([-1, logits.shape[-1]])
        flat_labels = labels.reshape([-1, 1]).astype("int64")
        loss = loss_fn(flat_logits.astype("float32"), flat_labels)
        valid = (flat_labels != ignore_index).astype("float32")
        return (loss.astype("float32") * valid).sum(), valid.sum()

    def whole_vocab(self, logits: Any) -> Any:
        """The vocabulary-split logits [..., vocab / tp] gathered over the group into [..., vocab], the
        same on every rank (sampling needs the whole distribution)."""
        from paddle.distributed.fleet.layers.mpu import mp_ops

        return mp_ops._c_concat(logits, group=self.mp_group)

    def vocab_reduce(self, value: Any, op: str) -> Any:
        """A per-row "max" or "sum" of each rank's vocabulary shard combined over the group (no gradient:
        an all-reduce of a copy)."""
        import paddle.distributed as dist

        out = value.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.mp_group)
        return out

    def linear_kind(self, layer: Any) -> Optional[str]:
        """ "column" or "row" for a split linear layer this factory made, "whole" for an nn.Linear, None for
        any other layer (the quantised base's targets)."""
        import paddle
        from paddle.distributed.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

        if isinstance(layer, ColumnParallelLinear):
            return "column"
        if isinstance(layer, RowParallelLinear):
            return "row"
        return "whole" if isinstance(layer, paddle.nn.Linear) else None

    def group_max(self, values: np.ndarray) -> np.ndarray:
        """The element-wise maximum of ``values`` over the model-parallel group (collective)."""
        import paddle
        import paddle.distributed as dist

        t = paddle.to_tensor(np.ascontiguousarray(values))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.mp_group)
        return t.numpy()

    def quantized_linear(self, layer: Any, q: QuantizedWeight, bias: Any, dtype: str, impl: str) -> Any:
        """This rank's quantised shard of ``layer`` (its weight's shard quantised as ``q``)."""
        kind = self.linear_kind(layer)
        if kind not in ("column", "row"):
            return QuantLinear(q, bias, dtype, impl)
        why = shard_mismatch(q.method, q.block_size, kind, q.shape[0], q.shape[1])
        if why:  # validate-config refuses these shapes first (config/quant_checks.py)
            raise UserError(f"tensor_parallel with a quantised base: {why}")
        return ShardedQuantLinear(q, bias, dtype, impl, kind, self)

    def __repr__(self) -> str:
        return f"TensorParallelFactory(tp_degree={self.tp_degree}, tp_rank={self.tp_rank})"
