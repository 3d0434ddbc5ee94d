"""Worker for test_expert_dispatch.py: this rank's rows (sorted by expert, some experts without rows, one
rank possibly without any) through parallel/expert_parallel.dispatch to experts split over the group,
forward and backward, written as npz (output, the rows' gradient, the held experts' weight gradients).

Run under `python -m paddle.distributed.launch --nproc_per_node N`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import paddle
import paddle.distributed as dist

from bmtrain_cli.ops.moe_experts import reference_experts, swiglu_expert
from bmtrain_cli.parallel import cpu_compat
from bmtrain_cli.parallel.expert_parallel import ExpertGroup, dispatch

EXPERTS, HIDDEN, FFN = 8, 6, 5


def problem(world: int, empty_rank: int):
    """Per rank: counts [EXPERTS] and rows [sum, HIDDEN], loss weights; the experts' weights."""
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 4, (world, EXPERTS))
    counts[:, 1] = 0  # an expert nobody routes to: zero gradients, not missing ones
    if 0 <= empty_rank < world:
        counts[empty_rank] = 0  # a rank that sends nothing
    rows = [rng.standard_normal((int(c.sum()), HIDDEN)).astype("float32") for c in counts]
    loss_w = [rng.standard_normal(r.shape).astype("float32") for r in rows]
    weights = [
        rng.standard_normal((EXPERTS, *shape)).astype("float32") * 0.5
        for shape in ((HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN))
    ]
    return counts, rows, loss_w, weights


def group_of_all() -> ExpertGroup:
    """The distributed environment started on the CPU, every launched process in one expert group."""
    cpu_compat.apply_if_cpu()
    paddle.set_device("cpu")
    dist.init_parallel_env()
    ranks = list(range(dist.get_world_size()))
    whole = dist.new_group(ranks)
    dist.barrier()
    return ExpertGroup(whole, ranks, dist.get_rank(), pairs=cpu_compat.pair_groups(ranks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--empty-rank", type=int, default=-1)
    args = ap.parse_args()
    group = group_of_all()
    world, rank = group.degree, group.rank
    counts, rows, loss_w, weights = problem(world, args.empty_rank)
    owned = list(group.owned(EXPERTS))
    held = [[paddle.to_tensor(w[e], stop_gradient=False) for e in owned] for w in weights]
    experts = [swiglu_expert(g, u, d) for g, u, d in zip(*held)]
    x = paddle.to_tensor(rows[rank], stop_gradient=False)

    def run_held(local_rows, local_counts):
        return reference_experts(local_rows, local_counts, experts)

    out = dispatch(group, x, [int(c) for c in counts[rank]], run_held)
    (out * paddle.to_tensor(loss_w[rank])).sum().backward()
    grads = {f"d{n}": np.stack([t.grad.numpy() for t in ts]) for n, ts in zip(("gate", "up", "down"), held)}
    np.savez(f"{args.out}.{rank}.npz", out=out.numpy(), dx=x.grad.numpy(), owned=owned, **grads)


if __name__ == "__main__":
    main()
