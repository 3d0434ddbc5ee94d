"""``kernels: auto`` on a CPU: each op's implementation chosen by timing the candidates on the model's shapes.

For every op the candidates (our kernel, Paddle's fused op where the device has one, the pure-Paddle
reference) run forward + backward on inputs shaped like the model's (``OpShapes``: a row of
``ELEMENTWISE_TOKENS`` tokens for RMSNorm, RoPE and SwiGLU; for the LM-head losses as many tokens as make
``HEAD_LOGITS`` logits, at least ``MIN_HEAD_TOKENS``: with fewer, fixed per-call costs decide and the
choice is wrong for real batches; measured: 32 tokens picked the reference linear + cross-entropy for the
toy shape, whose logsumexp and take_along_axis gradient then cost ~0.8 s per 2048-token step). The
candidates alternate (A, B, A, B, ...) after a warm-up and each keeps its best of ``REPEATS``, so load
from other processes, which only ever adds time, hits all of them alike; the fastest wins. One op's
inputs are alive at a time. It takes 0.2-3 s once per machine and shape (the LM head of a 49k vocabulary
dominates): ops/choice.py records the result, which later runs and `bmtrain plan` read.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

import paddle

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.ops.choice import OP_NAMES, OpShapes, Picks

ELEMENTWISE_TOKENS = 512
HEAD_LOGITS = 1 << 21
MIN_HEAD_TOKENS = 32
REPEATS = 5
SWITCH_MARGIN = 1.25  # another candidate must be this much faster to replace the static order's


def _param(shape: List[int], scale: float = 1.0) -> paddle.Tensor:
    t = paddle.randn(shape, dtype="float32") * scale
    t.stop_gradient = False
    return t


def _loss(out: object) -> paddle.Tensor:
    parts = out if isinstance(out, (tuple, list)) else [out]
    return paddle.add_n([p.sum() for p in parts if isinstance(p, paddle.Tensor) and not p.stop_gradient])


def _case(op: str, s: OpShapes) -> Callable[[Callable], Callable[[], None]]:
    """For one op: given an implementation, a closure that runs its forward + backward once. The inputs
    are made here, per op, so that one op's tensors are alive at a time."""
    t, n = ELEMENTWISE_TOKENS, max(MIN_HEAD_TOKENS, HEAD_LOGITS // max(s.vocab, 1))

    def run(fn: Callable[[], object]) -> Callable[[], None]:
        def once() -> None:
            _loss(fn()).backward()

        return once

    if op == "rms_norm":
        x, w = _param([t, s.hidden]), _param([s.hidden])
        return lambda impl: run(lambda: impl(x, w, 1e-6))
    if op == "rotary":
        q, k = _param([1, t, s.heads, s.head_dim]), _param([1, t, s.kv_heads, s.head_dim])
        cos, sin = paddle.randn([1, t, s.head_dim]), paddle.randn([1, t, s.head_dim])
        return lambda impl: run(lambda: impl(q, k, cos, sin))
    if op == "swiglu":
        gate, up = _param([t, s.ffn]), _param([t, s.ffn])
        return lambda impl: run(lambda: impl(gate, up))
    labels = paddle.randint(0, s.vocab, [n], dtype="int64")
    if op == "linear_cross_entropy":
        h = _param([n, s.hidden], 0.02)
        head = _param([s.vocab, s.hidden] if s.tied else [s.hidden, s.vocab], 0.02)
        return lambda impl: run(lambda: impl(h, head, labels, IGNORE_INDEX, s.tied))
    logits = _param([n, s.vocab])
    return lambda impl: run(lambda: impl(logits, labels, IGNORE_INDEX))


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
) -> Picks:
    """For each op with more than one candidate: (fastest source, {source: seconds}). ``candidates`` maps
    a source name ("custom", "paddle", "reference") to its ops. ``default`` (op -> source: the static
    order, which the memory plan counts) keeps an op unless another candidate is faster by SWITCH_MARGIN:
    the candidates keep different activations (the reference RMSNorm and RoPE keep more), so a switch on
    timing noise would move the peak away from `bmtrain plan`'s estimate (measured: -19% on a calibration
    case) for no real speed."""
    chosen: Picks = {}
    for op in OP_NAMES:
        impls = {src: ops[op] for src, ops in candidates.items() if op in ops}
        if len(impls) < 2:
            continue
        make = _case(op, shapes)
        times = _best_times({src: make(fn) for src, fn in impls.items()})
        del make
        fastest = min(times, key=times.__getitem__)
        usual = (default or {}).get(op)
        if usual in times and times[fastest] * SWITCH_MARGIN > times[usual]:
            fastest = usual
        chosen[op] = (fastest, times)
    return chosen
