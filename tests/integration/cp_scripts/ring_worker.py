"""Worker for test_ring_attention.py: ring attention (or with ``--ulysses`` the all-to-all of heads around
the blocked attention, parallel/ulysses.py; with ``--fused`` the fused CPU kernel per chunk pair,
parallel/ring_pairs.py) of this rank's chunks of one random batch (the same on every
rank), forward and backward, written as npz (local output and gradients with the indices held).

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

from bmtrain_cli.models.attention import blocked_attention
from bmtrain_cli.parallel import cpu_compat
from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices
from bmtrain_cli.parallel.ulysses import UlyssesCore


def problem(seq: int, packed: bool, heads: int = 4, kv_heads: int = 2):
    """q [2, seq, heads, 8], k/v [2, seq, kv_heads, 8] (grouped-query), a weight for the loss, segment
    ids."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, seq, heads, 8)).astype("float32")
    k = rng.standard_normal((2, seq, kv_heads, 8)).astype("float32")
    v = rng.standard_normal((2, seq, kv_heads, 8)).astype("float32")
    w = rng.standard_normal((2, seq, heads, 8)).astype("float32")
    seg = None
    if packed:  # row 0: three samples, row 1: two samples then padding; boundaries inside chunks
        seg = np.ones((2, seq), dtype="int64")
        seg[0, seq // 5 :] = 2
        seg[0, seq // 2 + 3 :] = 3
        seg[1, seq // 3 :] = 2
        seg[1, seq - seq // 7 :] = 0
    return q, k, v, w, seg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--packed", action="store_true")
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--ulysses", action="store_true")
    ap.add_argument("--fused", action="store_true", help="the fused CPU kernel per chunk pair")
    ap.add_argument("--heads", type=int, nargs=2, default=[4, 2])
    args = ap.parse_args()
    cpu_compat.apply_if_cpu()  # as training does: a new gloo group of all 4 ranks reuses the default one's
    paddle.set_device("cpu")
    dist.init_parallel_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    ranks = list(range(world))
    group = dist.new_group(ranks)
    dist.barrier()
    idx = local_indices(args.seq, world, rank)
    q, k, v, w, seg = problem(args.seq, args.packed, *args.heads)
    tensors = [paddle.to_tensor(x[:, idx]) for x in (q, k, v)]
    for t in tensors:
        t.stop_gradient = False
    seg_t = None if seg is None else paddle.to_tensor(seg)
    if args.ulysses:
        pairs = {(0, 1): group} if world == 2 else cpu_compat.pair_groups(ranks)
        core = UlyssesCore(Ring(group, ranks, rank, pairs))
        out = core(*tensors, seg_t, lambda *a: blocked_attention(*a, block=args.block))
    else:
        out = RingCore(Ring(group, ranks, rank), block=args.block, fused=args.fused)(*tensors, seg_t)
    (out * paddle.to_tensor(w[:, idx])).sum().backward()
    np.savez(
        f"{args.out}.{rank}.npz",
        idx=idx,
        out=out.numpy(),
        dq=tensors[0].grad.numpy(),
        dk=tensors[1].grad.numpy(),
        dv=tensors[2].grad.numpy(),
    )


if __name__ == "__main__":
    main()
