"""The fused CPU attention core: a checked wrapper over the custom operators bmt_attention_fwd / _bwd
(kernels/paddle/attention_op.cc -> kernels/cpu/attention_cpu.cc) and its autograd.

Causal attention in the model's layout, q [b, s, h, d] over k, v [b, s, hk, d] (grouped-query: hk divides
h; K/V are never repeated), optionally block-diagonal by int segment ids [b, s] (models/attention.py's
semantics: a query sees the keys at the same or an earlier index with its segment id). float32 and float64
on a CPU. The forward keeps only the per-query log-sum-exp [b, h, s] beside its inputs and output; the
backward recomputes the probabilities from it, so the memory is linear in the sequence length.
models/attention.py runs it as the ``cpu_fused`` kernel when the model's op set carries it
(``OpSet.attention``: kernels ``custom`` or ``auto`` on a CPU with the extension built).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.custom import contiguous

_DTYPES = (paddle.float32, paddle.float64)


class _FusedAttention(PyLayer):
    @staticmethod
    def forward(
        ctx: Any,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        seg: Optional[paddle.Tensor],
        scale: float,
    ) -> paddle.Tensor:
        out, lse = load_extension().bmt_attention_fwd(q, k, v, seg, scale)
        # a copy of the segment ids: the caller's tensor may be released before the backward (fleet's
        # pipeline frees the tensors a stage has sent on, and the ids travel with the activations)
        kept = None if seg is None else seg.clone()
        ctx.save_for_backward(q, k, v, out, lse, kept)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: the forward's output grads in, None grads out
        ctx: Any, dout: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        q, k, v, out, lse, seg = ctx.saved_tensor()
        dq, dk, dv = load_extension().bmt_attention_bwd(q, k, v, seg, out, lse, contiguous(dout), ctx.scale)
        return (dq, dk, dv) if seg is None else (dq, dk, dv, None)


def _check(q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seg: Optional[paddle.Tensor]) -> None:
    op = "fused_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise ValueError(
                f"{op}: {name} is {t.dtype}; the fused CPU attention takes float32 or float64 "
                "(fp16/bf16 attention runs Paddle's flash kernels on a GPU)"
            )
        if not t.place.is_cpu_place():
            raise ValueError(f"{op}: {name} is on {t.place}; the fused attention is a CPU kernel")
    if q.ndim != 4 or k.ndim != 4 or list(k.shape) != list(v.shape):
        raise ValueError(
            f"{op}: q must be [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, head_dim], "
            f"got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    b, s, h, d = q.shape
    hk = k.shape[2]
    if [k.shape[0], k.shape[1], k.shape[3]] != [b, s, d] or hk == 0 or h % hk:
        raise ValueError(
            f"{op}: k/v {list(k.shape)} do not fit q {list(q.shape)} (same batch, seq and head_dim; "
            "the kv heads must divide the query heads)"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if seg is not None:
        if list(seg.shape) != [b, s] or seg.dtype not in (paddle.int32, paddle.int64):
            raise ValueError(f"{op}: segment ids must be int [{b}, {s}], got {seg.dtype} {list(seg.shape)}")


def fused_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    segment_ids: Optional[paddle.Tensor] = None,
    scale: Optional[float] = None,
) -> paddle.Tensor:
    """Causal attention q [b, s, h, d] over k, v [b, s, hk, d] -> [b, s, h, d] (see the module docstring);
    ``segment_ids`` int [b, s] restrict each query to its segment; ``scale`` defaults to head_dim ** -0.5.
    Raises ValueError for a wrong shape, dtype or device."""
    _check(q, k, v, segment_ids)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    seg = None if segment_ids is None else contiguous(segment_ids.astype("int64"))
    q, k, v = contiguous(q), contiguous(k), contiguous(v)
    if paddle.is_grad_enabled() and not (q.stop_gradient and k.stop_gradient and v.stop_gradient):
        return _FusedAttention.apply(q, k, v, seg, scale)
    return load_extension().bmt_attention_fwd(q, k, v, seg, scale)[0]


def _check_pair(q: paddle.Tensor, k: paddle.Tensor, causal: bool, window: int, softcap: float) -> None:
    op = "attention_pair"
    if window < 0:
        raise ValueError(f"{op}: the window must be positive (0: none), got {window}")
    if not softcap >= 0:
        raise ValueError(f"{op}: the soft cap must be positive (0: none), got {softcap}")
    if q.ndim != 4 or k.ndim != 4 or [k.shape[0], k.shape[3]] != [q.shape[0], q.shape[3]]:
        raise ValueError(f"{op}: q {list(q.shape)} and k/v {list(k.shape)} do not fit")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"{op}: a causal pair needs as many queries as keys, got {q.shape[1]} and {k.shape[1]}"
        )
    if q.dtype not in _DTYPES or not q.place.is_cpu_place():
        raise ValueError(
            f"{op}: the fused CPU attention takes float32 or float64 on a CPU, got {q.dtype} on {q.place}"
        )


class Pair(NamedTuple):
    """One (query chunk, key chunk) pair of a ring attention: q [b, sq, h, d] over k, v [b, sk, hk, d],
    ``causal`` (the diagonal pair, sq == sk) or every key visible, ``segments`` the int64 ids of the queries
    [b, sq] and of the keys [b, sk] (a query sees only keys with its id) or None, the score ``scale``;
    a sliding ``window`` (0: none) with the queries' ``offset`` (query i sits offset positions after key 0
    in the sequence): query i sees only the keys j with i + offset - j < window; a ``softcap`` (0: none) of
    the scaled scores s, which become softcap * tanh(s / softcap) before the mask (Gemma 2)."""

    q: paddle.Tensor
    k: paddle.Tensor
    v: paddle.Tensor
    segments: Optional[Tuple[paddle.Tensor, paddle.Tensor]]
    causal: bool
    scale: float
    window: int = 0
    offset: int = 0
    softcap: float = 0.0


def attention_pair_forward(pair: Pair) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """One chunk pair's attention (no autograd: the ring's own backward calls
    :func:`attention_pair_backward`). Returns the output [b, sq, h, d] and the per-query log-sum-exp
    [b, h, sq] in q's dtype (a query that sees no key: output 0, log-sum-exp -1e30)."""
    q, k, v, segments, causal, scale, window, offset, softcap = pair
    _check_pair(q, k, causal, window, softcap)
    qs, ks = (None, None) if segments is None else segments
    return load_extension().bmt_attention_pair_fwd(
        q, k, v, qs, ks, bool(causal), float(scale), int(window), int(offset), float(softcap)
    )


def attention_pair_backward(
    pair: Pair, lse: paddle.Tensor, delta: paddle.Tensor, dout: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """The gradients (dq, dk, dv) of one pair's share of an attention whose merged log-sum-exp is ``lse``
    and whose D = rowsum(dO * O) is ``delta`` (both [b, h, sq], q's dtype), given its output's gradient
    ``dout`` [b, sq, h, d] (the FlashAttention-2 recurrences: P = exp(S scale - lse), dS = P (dP - D) scale,
    times the cap's derivative 1 - tanh^2 with a soft cap).
    """
    q, k, v, segments, causal, scale, window, offset, softcap = pair
    _check_pair(q, k, causal, window, softcap)
    qs, ks = (None, None) if segments is None else segments
    return load_extension().bmt_attention_pair_bwd(
        q,
        k,
        v,
        qs,
        ks,
        lse,
        delta,
        dout,
        bool(causal),
        float(scale),
        int(window),
        int(offset),
        float(softcap),
    )
