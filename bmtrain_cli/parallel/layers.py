"""Tensor-parallel layer factory: the same methods as models.layers.PlainFactory over fleet's mp layers.

The decoder asks the factory for every projection; with this factory the q/k/v/gate/up projections are
column-parallel (output features split), o/down row-parallel (input features split, output all-reduced),
the embedding and the LM head are split over the vocabulary, and the loss is fleet's
ParallelCrossEntropy over the vocabulary shards. Model code does not change.

Every split parameter carries fleet's ``is_distributed`` and ``split_axis`` attributes; the context's
``full_state_dict``/``load_full_state_dict`` use them to gather and split checkpoints, so saved weights are
always whole tensors.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


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

    def __repr__(self) -> str:
        return f"TensorParallelFactory(tp_degree={self.tp_degree}, tp_rank={self.tp_rank})"
