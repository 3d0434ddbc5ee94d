"""Train your own Paddle model with bmtrain_cli's Python API (docs/api.md).

A small language model defined below (embedding, two MLP blocks, norm, head) learns a synthetic
next-token rule. The same file runs in one process or under the launcher in any layout:

python recipes/custom_model.py
python -m paddle.distributed.launch --nproc_per_node 2 recipes/custom_model.py                        # dp2
python -m paddle.distributed.launch --nproc_per_node 2 recipes/custom_model.py --tensor_parallel 2    # tp2
python -m paddle.distributed.launch --nproc_per_node 2 recipes/custom_model.py --pipeline_parallel 2  # pp2
python -m paddle.distributed.launch --nproc_per_node 4 recipes/custom_model.py --tensor_parallel 2    # dp2 x tp2
python -m paddle.distributed.launch --nproc_per_node 2 recipes/custom_model.py --sharding_parallel 2  # ZeRO-1

Every layout prints the same losses as one process: each data rank trains on its own rows of the global
batch, and train_step returns the mean over the whole global batch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import paddle
from paddle import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from bmtrain_cli import (
    DataParallel,
    PipelineParallel,
    TensorParallel,
    init_distributed,
    init_distributed_mode,
    train_step,
)

VOCAB, HIDDEN, INNER, SEQ = 64, 32, 128, 16


class Block(nn.Layer):
    """Pre-norm MLP block with a residual: fc1 and fc2 are the Linear pair TensorParallel splits."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inner)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def build_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Embedding(VOCAB, HIDDEN),
        Block(HIDDEN, INNER),
        Block(HIDDEN, INNER),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, VOCAB),
    )


def loss_fn(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Mean token cross entropy: every row has SEQ tokens, so this is the mean over the rows."""
    return nn.functional.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1]))


def global_batch(step: int, rows: int) -> tuple:
    """Sequences following x[t+1] = (5 x[t] + 3) mod VOCAB from random starts, and their next tokens."""
    rng = np.random.RandomState(1000 + step)
    seq = np.zeros((rows, SEQ + 1), dtype="int64")
    seq[:, 0] = rng.randint(0, VOCAB, rows)
    for t in range(SEQ):
        seq[:, t + 1] = (5 * seq[:, t] + 3) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main(argv: list) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor_parallel", type=int, default=1)
    ap.add_argument("--pipeline_parallel", type=int, default=1)
    ap.add_argument("--sharding_parallel", type=int, default=1, help="optimizer state split (stage 1)")
    ap.add_argument("--micro_batches", type=int, default=None, help="pipeline micro-batches per step")
    ap.add_argument("--partition", default="uniform", choices=["uniform", "parameters", "measured"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--global_batch", type=int, default=8)
    ap.add_argument("--max_grad_norm", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="write the per-step losses as JSON here (rank 0)")
    args = ap.parse_args(argv)

    ctx = init_distributed(
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        sharding_parallel=args.sharding_parallel,
    )
    init_distributed_mode()  # prints rank, world, devices, degrees, Paddle build
    if args.global_batch % ctx.data_world:
        raise SystemExit(
            f"--global_batch {args.global_batch} does not divide over {ctx.data_world} data ranks"
        )
    rows = args.global_batch // ctx.data_world

    model = build_model()  # the whole model on every rank; init_distributed seeded them alike
    probe = paddle.to_tensor(global_batch(-1, 2)[0])
    with paddle.no_grad():
        expected = model(probe).numpy()

    model = DataParallel(
        model, group_size=ctx.data_world, sharding_stage=1 if args.sharding_parallel > 1 else None
    )
    model = TensorParallel(model, split_dim=1)
    tp_diff = None
    if args.tensor_parallel > 1 and args.pipeline_parallel == 1:
        with paddle.no_grad():
            tp_diff = float(np.abs(model(probe).numpy() - expected).max())
        print(f"tensor-parallel outputs vs the whole model: max difference {tp_diff:.2e}", flush=True)
    model = PipelineParallel(
        model,
        stages=args.pipeline_parallel,
        loss_fn=loss_fn,
        micro_batches=args.micro_batches,
        partition=args.partition,
        sample_input=probe,
    )

    clip = nn.ClipGradByGlobalNorm(args.max_grad_norm)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters(), grad_clip=clip)
    losses = []
    for step in range(args.steps):
        inputs, labels = global_batch(step, args.global_batch)
        mine = slice(ctx.data_rank * rows, (ctx.data_rank + 1) * rows)  # this data rank's rows
        loss = train_step(model, (inputs[mine], labels[mine]), loss_fn, optimizer)
        losses.append(loss)
        if ctx.rank == 0:
            print(f"step {step + 1}: loss {loss:.6f}", flush=True)
    if args.out and ctx.rank == 0:
        result = {"losses": losses, "tp_output_max_diff": tp_diff, "pipeline": ctx.pipeline_info}
        Path(args.out).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
