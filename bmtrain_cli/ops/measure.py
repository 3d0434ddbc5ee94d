"""``kernels: auto`` on a CPU: each op's implementation chosen by timing the candidates on the model's shapes.

For every op the candidates (our kernel, Paddle's fused op where the device has one, the pure-Paddle
reference) run forward + backward on inputs shaped like the model's (``OpShapes``: a row of
``ELEMENTWISE_TOKENS`` tokens for RMSNorm, RoPE and SwiGLU; for the LM-head losses as many tokens as make
``HEAD_LOGITS`` logits, at least ``MIN_HEAD_TOKENS``: with fewer, fixed per-call costs decide and the
choice is wrong for real batches; measured: 32 tokens picked the reference linear + cross-entropy for the
toy shape, whose logsumexp and take_along_axis gradient then cost ~0.8 s per 2048-token step). The candidates alternate (A, B, A, B, ...) after a warm-up and each
keeps its best of ``REPEATS``, so load from other processes, which only ever adds time, hits all of them
alike; the fastest wins. It takes 0.2-3 s once per process and shape (the LM head of a 49k vocabulary
dominates); ops/__init__.select caches the result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import paddle

from bmtrain_cli.labels import IGNORE_INDEX

ELEMENTWISE_TOKENS = 512
HEAD_LOGITS = 1 << 21
MIN_HEAD_TOKENS = 32
REPEATS = 5
SWITCH_MARGIN = 1.25  # another candidate must be this much faster to replace the static order's


@dataclass(frozen=True)
class OpShapes:
    """What the op timings need from a model's architecture."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @classmethod
    def of(cls, arch: Any) -> OpShapes:
        a = arch
        return cls(
            hidden=int(a.hidden_size),
            heads=int(a.num_attention_heads),
            kv_heads=int(a.num_key_value_heads),
            head_dim=int(a.head_dim),
            ffn=int(a.intermediate_size),
            vocab=int(a.vocab_size),
            tied=bool(a.tie_word_embeddings),
        )


def _param(shape: List[int], scale: float = 1.0) -> paddle.Tensor:
    t = paddle.randn(shape, dtype="float32") * scale
    t.stop_gradient = False
    return t


def _loss(out: object) -> paddle.Tensor:
    parts = out if isinstance(out, (tuple, list)) else [out]
    return paddle.add_n([p.sum() for p in parts if isinstance(p, paddle.Tensor) and not p.stop_gradient])


def _cases(s: OpShapes) -> Dict[str, Callable[[Callable], Callable[[], None]]]:
    """For each op: given an implementation, a closure that runs its forward + backward once."""
    t, n = ELEMENTWISE_TOKENS, max(MIN_HEAD_TOKENS, HEAD_LOGITS // max(s.vocab, 1))
    x, w = _param([t, s.hidden]), _param([s.hidden])
    q, k = _param([1, t, s.heads, s.head_dim]), _param([1, t, s.kv_heads, s.head_dim])
    cos, sin = paddle.randn([1, t, s.head_dim]), paddle.randn([1, t, s.head_dim])
    gate, up = _param([t, s.ffn]), _param([t, s.ffn])
    h = _param([n, s.hidden], 0.02)
    head = _param([s.vocab, s.hidden] if s.tied else [s.hidden, s.vocab], 0.02)
    labels = paddle.randint(0, s.vocab, [n], dtype="int64")
    logits = _param([n, s.vocab])

    def run(fn: Callable[[], object]) -> Callable[[], None]:
        def once() -> None:
            _loss(fn()).backward()

        return once

    return {
        "rms_norm": lambda op: run(lambda: op(x, w, 1e-6)),
        "rotary": lambda op: run(lambda: op(q, k, cos, sin)),
        "swiglu": lambda op: run(lambda: op(gate, up)),
        "linear_cross_entropy": lambda op: run(lambda: op(h, head, labels, IGNORE_INDEX, s.tied)),
        "cross_entropy_sum": lambda op: run(lambda: op(logits, labels, IGNORE_INDEX)),
    }


def _best_times(runs: Dict[str, Callable[[], None]]) -> Dict[str, float]:
    """Each candidate's best time over REPEATS rounds in which the candidates alternate."""
    for once in runs.values():
        once()  # warm-up: first-call allocations, kernel build/JIT
    best = {src: float("inf") for src in runs}
    for _ in range(REPEATS):
        for src, once in runs.items():
            t0 = time.perf_counter()
            once()
            best[src] = min(best[src], time.perf_counter() - t0)
    return best


def choose(
    shapes: OpShapes, candidates: Dict[str, Dict[str, Callable]], default: Optional[Dict[str, str]] = None
) -> Dict[str, Tuple[str, Dict[str, float]]]:
    """For each op with more than one candidate: (fastest source, {source: seconds}). ``candidates`` maps
    a source name ("custom", "paddle", "reference") to its ops. ``default`` (op -> source: the static
    order, which the memory plan counts) keeps an op unless another candidate is faster by SWITCH_MARGIN:
    the candidates keep different activations (the reference RMSNorm and RoPE keep more), so a switch on
    timing noise would move the peak away from `bmtrain plan`'s estimate (measured: -19% on a calibration
    case) for no real speed."""
    cases = _cases(shapes)
    chosen: Dict[str, Tuple[str, Dict[str, float]]] = {}
    for op, make in cases.items():
        impls = {src: ops[op] for src, ops in candidates.items() if op in ops}
        if len(impls) < 2:
            continue
        times = _best_times({src: make(fn) for src, fn in impls.items()})
        fastest = min(times, key=times.__getitem__)
        usual = (default or {}).get(op)
        if usual in times and times[fastest] * SWITCH_MARGIN > times[usual]:
            fastest = usual
        chosen[op] = (fastest, times)
    return chosen
