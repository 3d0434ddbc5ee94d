"""A user model that keeps its layers in one nn.LayerList, trained through the API with an explicit
tensor-parallel plan, the measured pipeline partition and the loss given to PipelineParallel only.
Writes rank 0's per-step losses as JSON (one process without the launcher: the reference)."""

from __future__ import annotations

import json
import sys

import numpy as np
import paddle
from paddle import nn

import bmtrain_cli as bmt

VOCAB, HIDDEN = 48, 24


class Mix(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.act = nn.Silu()
        self.down = nn.Linear(4 * HIDDEN, HIDDEN, bias_attr=False)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.LayerList([nn.Embedding(VOCAB, HIDDEN), Mix(), Mix(), nn.Linear(HIDDEN, VOCAB)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def main(out: str, tp: int, pp: int) -> None:
    ctx = bmt.init_distributed(tensor_parallel=tp, pipeline_parallel=pp, seed=7)
    model = Net()
    plan = {"layers.0": "vocab", "layers.*.up": "column", "layers.*.down": "row", "layers.3": "column"}
    model = bmt.TensorParallel(model, plan=plan, degree=tp)
    sample = paddle.randint(0, VOCAB, [2, 12])
    model = bmt.PipelineParallel(
        model, stages=pp, loss_fn=loss_fn, micro_batches=2, partition="measured", sample_input=sample
    )
    opt = paddle.optimizer.SGD(
        learning_rate=0.5, parameters=model.parameters(), grad_clip=nn.ClipGradByGlobalNorm(0.5)
    )
    rng = np.random.RandomState(3)
    losses = []
    for _ in range(3):
        ids = rng.randint(0, VOCAB, (8, 13))
        rows = 8 // ctx.data_world
        mine = ids[ctx.data_rank * rows : (ctx.data_rank + 1) * rows]
        losses.append(bmt.train_step(model, (mine[:, :-1], mine[:, 1:]), None, opt))
    if ctx.rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "pipeline": ctx.pipeline_info}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
