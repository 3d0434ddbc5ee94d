"""Time of the attention core alone (forward + backward) on a CPU: the fused C++ kernel (``cpu_fused``,
kernels/cpu/attention_cpu.cc), the blocked kernel in Paddle ops and Paddle's sdpa (one matmul + softmax),
by sequence length at a fixed number of tokens, then on the SmolLM2-135M layer shape (batch 2, 190 tokens,
heads 9 / 3). Without the fused kernel (no compiler, kernels paddle/reference) the sdpa / blocked crossover
is the measured rule ``DENSE_MAX_SEQ`` of bmtrain_cli/models/attention_choice.py.

fp32, heads 4 / KV heads 4 and 9 / 3 (the toy and SmolLM2 head layouts), head dim 64, 4096 tokens per call
(batch = 4096 / seq); the kernels alternate in one process, best of 5 each (best of 20 on the real shape).

    OMP_NUM_THREADS=2 python benchmarks/bench_attention_core.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paddle
import paddle.nn.functional as F

import bmtrain_cli  # noqa: F401  (its MKL setting, as training has it)
from bmtrain_cli.models.attention import blocked_attention
from bmtrain_cli.ops.fused_attention import fused_attention

SEQS = (128, 256, 512, 1024, 2048)
HEADS = ((4, 4), (9, 3))
TOKENS, HEAD_DIM, REPEATS = 4096, 64, 5
REAL = (2, 190, 9, 3)  # SmolLM2-135M: batch 2 x 190 tokens, 9 query heads, 3 KV heads


def _once(fn: Callable[[], paddle.Tensor]) -> float:
    t0 = time.perf_counter()
    fn().sum().backward()
    return time.perf_counter() - t0


def _leaf(shape: list) -> paddle.Tensor:
    t = paddle.randn(shape)
    t.stop_gradient = False
    return t


def time_kernels(b: int, seq: int, heads: int, kv_heads: int, repeats: int = REPEATS) -> Dict[str, float]:
    """Best forward + backward seconds of each kernel, alternating."""
    q, k, v = (_leaf([b, seq, n, HEAD_DIM]) for n in (heads, kv_heads, kv_heads))
    fns: Dict[str, Callable[[], paddle.Tensor]] = {
        "fused": lambda: fused_attention(q, k, v),
        "blocked": lambda: blocked_attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, training=True),
    }
    best = {name: float("inf") for name in fns}
    for fn in fns.values():  # warm-up (the extension's build or load, first allocations)
        _once(fn)
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], _once(fn))
    return best


def _row(label: str, best: Dict[str, float]) -> str:
    ms = {n: t * 1e3 for n, t in best.items()}
    return (
        f"{label} {ms['fused']:>9.1f} {ms['blocked']:>11.1f} {ms['sdpa']:>8.1f} "
        f"{best['sdpa'] / best['fused']:>14.2f}x"
    )


def main() -> Dict[str, float]:
    speedups: Dict[str, float] = {}
    header = f"{'fused ms':>9} {'blocked ms':>11} {'sdpa ms':>8} {'fused vs sdpa':>15}"
    print(f"{'heads':>6} {'seq':>5} {header}")
    for h, hk in HEADS:
        for seq in SEQS:
            best = time_kernels(max(1, TOKENS // seq), seq, h, hk)
            speedups[f"{h}/{hk}@{seq}"] = best["sdpa"] / best["fused"]
            print(_row(f"{h:>3}/{hk:<2} {seq:>5}", best))
    b, seq, h, hk = REAL
    best = time_kernels(b, seq, h, hk, repeats=20)
    speedups["real"] = best["sdpa"] / best["fused"]
    print(f"\nSmolLM2-135M layer (batch {b}, seq {seq}, heads {h}/{hk}):\n{'':>12} {header}")
    print(_row(f"{'':>12}", best))
    return speedups


if __name__ == "__main__":
    main()
