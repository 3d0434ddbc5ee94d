"""A fresh tensor-parallel model holds exactly the single-process initial weights (each rank its slice).

The real tensor-parallel layers need a fleet group (multi-process, tests/integration/test_parallel_run.py);
here a factory builds the rank's plain local-shape layers marked the way fleet marks them
(``is_distributed``, ``split_axis``) and draws differently while constructing, like fleet's layers do.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.models import build
from bmtrain_cli.models.arch import ModelArch

ARCH = ModelArch(
    family="llama",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=64,
)


class FakeTensorParallel:
    def __init__(self, tp_degree: int, tp_rank: int) -> None:
        self.tp_degree, self.tp_rank = tp_degree, tp_rank

    def _mark(self, layer: nn.Layer, axis: int) -> nn.Layer:
        layer.weight.is_distributed = True
        layer.weight.split_axis = axis
        paddle.rand([7 + self.tp_rank])  # construction draws that one process does not make
        return layer

    def linear(self, in_f: int, out_f: int, bias: bool, tp=None) -> nn.Layer:
        if tp == "column":
            return self._mark(nn.Linear(in_f, out_f // self.tp_degree, bias_attr=False), 1)
        if tp == "row":
            return self._mark(nn.Linear(in_f // self.tp_degree, out_f, bias_attr=False), 0)
        return nn.Linear(in_f, out_f, bias_attr=False)

    def embedding(self, vocab: int, hidden: int) -> nn.Layer:
        return self._mark(nn.Embedding(vocab // self.tp_degree, hidden), 0)

    def lm_head(self, hidden: int, vocab: int) -> nn.Layer:
        return self._mark(nn.Linear(hidden, vocab // self.tp_degree, bias_attr=False), 1)


def test_fresh_tensor_parallel_shards_are_slices_of_the_single_process_weights():
    paddle.seed(123)
    whole = {k: v.numpy() for k, v in build(ARCH, kernels="reference").state_dict().items()}
    tp = 2
    for rank in range(tp):
        paddle.seed(123)
        model = build(ARCH, factory=FakeTensorParallel(tp, rank), kernels="reference")
        for name, p in model.named_parameters():
            want = whole[name]
            axis = getattr(p, "split_axis", None)
            if axis is not None:
                size = p.shape[axis]
                want = np.take(want, np.arange(rank * size, (rank + 1) * size), axis=axis)
            np.testing.assert_array_equal(p.numpy(), want, err_msg=f"rank {rank} {name}")
    # and the shards differ across ranks (no duplicated heads)
    assert whole["model.layers.0.self_attn.q_proj.weight"].std() > 0


def test_initial_weights_do_not_depend_on_construction_draws():
    paddle.seed(5)
    a = build(ARCH, kernels="reference").state_dict()
    paddle.seed(5)
    b = build(ARCH, factory=FakeTensorParallel(1, 0), kernels="reference").state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name].numpy(), b[name].numpy(), err_msg=name)
