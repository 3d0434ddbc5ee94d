"""Time of the attention core alone (forward + backward) on a CPU: the blocked kernel against Paddle's sdpa
(one matmul + softmax), by sequence length at a fixed number of tokens. The crossover is the measured rule
``DENSE_MAX_SEQ`` of bmtrain_cli/models/attention_choice.py.

fp32, heads 4 / KV heads 4 and 9 / 3 (the toy and SmolLM2 head layouts), head dim 64, 4096 tokens per call
(batch = 4096 / seq); the two kernels alternate in one process, best of 5 each.

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

SEQS = (128, 256, 512, 1024, 2048)
HEADS = ((4, 4), (9, 3))
TOKENS, HEAD_DIM, REPEATS = 4096, 64, 5


def _once(fn: Callable[[], paddle.Tensor]) -> float:
    t0 = time.perf_counter()
    fn().sum().backward()
    return time.perf_counter() - t0


def _leaf(shape: list) -> paddle.Tensor:
    t = paddle.randn(shape)
    t.stop_gradient = False
    return t


def time_pair(heads: int, kv_heads: int, seq: int) -> Dict[str, float]:
    """Best forward + backward seconds of the blocked kernel and of sdpa, alternating, TOKENS tokens."""
    b = max(1, TOKENS // seq)
    q, k, v = (_leaf([b, seq, n, HEAD_DIM]) for n in (heads, kv_heads, kv_heads))
    fns: Dict[str, Callable[[], paddle.Tensor]] = {
        "blocked": lambda: blocked_attention(q, k, v),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, training=True),
    }
    best = {name: float("inf") for name in fns}
    for _ in range(REPEATS):
        for name, fn in fns.items():
            best[name] = min(best[name], _once(fn))
    return best


def main() -> Dict[str, float]:
    ratios: Dict[str, float] = {}
    print(f"{'heads':>6} {'seq':>5} {'blocked ms':>11} {'sdpa ms':>8} {'sdpa speed-up':>14}")
    for h, hk in HEADS:
        for seq in SEQS:
            best = time_pair(h, hk, seq)
            ratio = best["blocked"] / best["sdpa"]
            ratios[f"{h}/{hk}@{seq}"] = ratio
            print(
                f"{h:>3}/{hk:<2} {seq:>5} {best['blocked'] * 1e3:>11.1f} {best['sdpa'] * 1e3:>8.1f} {ratio:>13.2f}x"
            )
    return ratios


if __name__ == "__main__":
    main()
