"""Blocked attention: exact causal attention one query block at a time in Paddle ops, with a custom
backward, so memory stays linear in the sequence length (no s x s tensor); sliding windows and soft-capped
scores computed inside the blocks. ``models/attention.py`` dispatches to it (the ``blocked`` kernel)."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.models.attention_choice import ATTENTION_BLOCK


def allowed_keys(
    seg_q: Optional[paddle.Tensor],
    seg_k: Optional[paddle.Tensor],
    q_len: int,
    k_len: int,
    q_offset: int,
    sliding_window: Optional[int] = None,
    k_offset: int = 0,
) -> paddle.Tensor:
    """Boolean [b or 1, q_len, k_len]: which keys each query may see (causal, same segment, window).
    Query i sits at index ``q_offset + i``, key j at ``k_offset + j``."""
    q_idx = paddle.arange(q_len, dtype="int64").unsqueeze(-1) + q_offset
    k_idx = paddle.arange(k_len, dtype="int64").unsqueeze(0) + k_offset
    allowed = (k_idx <= q_idx).unsqueeze(0)  # [1, q, k]
    if sliding_window is not None:
        allowed = paddle.logical_and(allowed, (q_idx - k_idx < sliding_window).unsqueeze(0))
    if seg_q is not None:
        assert seg_k is not None  # segment ids come for the queries and the keys together
        same = seg_q.unsqueeze(-1) == seg_k.unsqueeze(1)  # [b, q, k]
        allowed = paddle.logical_and(allowed, same)
    return allowed


def _block_scores(
    qg: paddle.Tensor, kt: paddle.Tensor, seg: Optional[paddle.Tensor], span: Tuple[int, int, int], opts: Any
) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
    """Masked fp32 scores of queries i0..i1 against keys j0..i1 (``span`` = (i0, i1, j0)):
    [b, kv_heads, rep * (i1 - i0), i1 - j0] (the rep query heads of a KV head stacked on the query axis;
    -inf where a key is not visible), and with soft-capping the derivative of the cap, 1 - tanh^2."""
    b, hk, rep, _, d = qg.shape
    i0, i1, j0 = span
    n = i1 - i0
    qb = qg[:, :, :, i0:i1].reshape([b, hk, rep * n, d])
    scores = paddle.matmul(qb, kt[:, :, j0:i1], transpose_y=True).astype("float32") * opts.scale
    slope = None
    if opts.softcap is not None:
        t = paddle.tanh(scores / opts.softcap)
        scores, slope = t * opts.softcap, 1.0 - t * t
    seg_q = None if seg is None else seg[:, i0:i1]
    seg_k = None if seg is None else seg[:, j0:i1]
    allowed = allowed_keys(seg_q, seg_k, n, i1 - j0, i0, opts.window, j0)  # [b or 1, n, i1 - j0]
    if rep > 1:
        allowed = paddle.tile(allowed, [1, rep, 1])
    neg = paddle.full([1], float("-inf"), dtype="float32")
    return paddle.where(allowed.unsqueeze(1), scores, neg), slope


def _grouped(x: paddle.Tensor, kv_heads: int) -> paddle.Tensor:
    """[b, s, kv_heads * rep, d] -> [b, kv_heads, rep, s, d] (query head j belongs to kv head j // rep)."""
    b, s, h, d = x.shape
    return x.reshape([b, s, kv_heads, h // kv_heads, d]).transpose([0, 2, 3, 1, 4])


def _ungrouped(x: paddle.Tensor) -> paddle.Tensor:
    """[b, kv_heads, rep, s, d] -> [b, s, kv_heads * rep, d]."""
    b, hk, rep, s, d = x.shape
    return x.transpose([0, 3, 1, 2, 4]).reshape([b, s, hk * rep, d])


class _BlockOptions:
    """The blocked kernel's settings: queries per block, the score scale, the sliding window (keys more
    than ``window - 1`` positions back are neither visible nor computed) and the soft-cap of the scores."""

    def __init__(self, block: int, scale: float, window: Optional[int], softcap: Optional[float]) -> None:
        self.block, self.scale, self.window, self.softcap = block, scale, window, softcap

    def spans(self, s: int) -> List[Tuple[int, int, int]]:
        """(i0, i1, j0): each block of queries i0..i1 with the first key any of them may see, j0."""
        return [
            (i, min(i + self.block, s), 0 if self.window is None else max(0, i - self.window + 1))
            for i in range(0, s, self.block)
        ]


class BlockedAttention(PyLayer):
    """Causal (optionally block-diagonal by segment ids) attention, one block of queries at a time.

    Forward keeps q, k, v, the output and the per-query log-sum-exp; backward recomputes each block's
    probabilities from them (the FlashAttention recurrences). Nothing of size s x s outlives a block, so
    the kept memory is linear in s and the transient is [b, heads, block, s] (block x window with a
    sliding window). K/V carry their own (fewer) heads: the query heads of one KV head are stacked on the
    query axis, so K/V are never repeated. Soft-capped scores (Gemma 2) multiply the score gradient by
    the cap's derivative, recomputed with the scores.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        seg: Optional[paddle.Tensor],
        opts: _BlockOptions,
    ) -> paddle.Tensor:
        b, s, h, d = q.shape
        hk = k.shape[2]
        qg = _grouped(q, hk)
        kt, vt = k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])  # [b, hk, s, d]
        outs, lses = [], []
        for i0, i1, j0 in opts.spans(s):
            n = i1 - i0
            scores, _ = _block_scores(qg, kt, seg, (i0, i1, j0), opts)
            lse = paddle.logsumexp(scores, axis=-1)  # [b, hk, rep * n]
            probs = paddle.exp(scores - lse.unsqueeze(-1)).astype(v.dtype)
            out = paddle.matmul(probs, vt[:, :, j0:i1])
            outs.append(out.reshape([b, hk, h // hk, n, d]))
            lses.append(lse.reshape([b, hk, h // hk, n]))
        out = _ungrouped(paddle.concat(outs, axis=3))
        # a copy of the segment ids: the caller's tensor may be released before the backward (fleet's
        # pipeline frees the tensors a stage has sent on, and the ids travel with the activations)
        kept_seg = None if seg is None else seg.clone()
        ctx.save_for_backward(q, k, v, out, paddle.concat(lses, axis=3), kept_seg)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: the forward's output grads in, None grads out
        ctx: Any, dout: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        q, k, v, out, lse, seg = ctx.saved_tensor()
        opts = ctx.opts
        b, s, h, d = q.shape
        hk = k.shape[2]
        rep = h // hk
        qg = _grouped(q, hk)
        dog = _grouped(dout, hk)
        kt, vt = k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])
        # D_i = sum_j P_ij dP_ij = dO_i . O_i
        delta = (dog.astype("float32") * _grouped(out, hk).astype("float32")).sum(axis=-1)  # [b, hk, rep, s]
        dk = paddle.zeros([b, hk, s, d], dtype="float32")
        dv = paddle.zeros([b, hk, s, d], dtype="float32")
        dqs = []
        for i0, i1, j0 in opts.spans(s):
            n = i1 - i0
            lse_b = lse[:, :, :, i0:i1].reshape([b, hk, rep * n, 1])
            scores, slope = _block_scores(qg, kt, seg, (i0, i1, j0), opts)
            probs = paddle.exp(scores - lse_b)
            dob = dog[:, :, :, i0:i1].reshape([b, hk, rep * n, d])
            qb = qg[:, :, :, i0:i1].reshape([b, hk, rep * n, d])
            dv[:, :, j0:i1] += paddle.matmul(probs.astype(v.dtype), dob, transpose_x=True).astype("float32")
            dp = paddle.matmul(dob, vt[:, :, j0:i1], transpose_y=True).astype("float32")
            ds = probs * (dp - delta[:, :, :, i0:i1].reshape([b, hk, rep * n, 1])) * opts.scale
            if slope is not None:
                ds = ds * slope
            ds = ds.astype(q.dtype)
            dqs.append(paddle.matmul(ds, kt[:, :, j0:i1]).reshape([b, hk, rep, n, d]))
            dk[:, :, j0:i1] += paddle.matmul(ds, qb, transpose_x=True).astype("float32")
        dq = _ungrouped(paddle.concat(dqs, axis=3))
        dk = dk.astype(k.dtype).transpose([0, 2, 1, 3])
        dv = dv.astype(v.dtype).transpose([0, 2, 1, 3])
        return (dq, dk, dv) if seg is None else (dq, dk, dv, None)


def blocked_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    segment_ids: Optional[paddle.Tensor] = None,
    block: int = ATTENTION_BLOCK,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> paddle.Tensor:
    """Exact causal attention q [b, s, h, d], k/v [b, s, kv_heads, d] -> [b, s, h, d] without an s x s
    tensor: see :class:`BlockedAttention`. ``segment_ids`` [b, s] restrict each query to its segment,
    ``window`` to the keys less than ``window`` positions back; ``softcap`` caps the scaled scores."""
    opts = _BlockOptions(block, float(q.shape[-1]) ** -0.5, window, softcap)
    return BlockedAttention.apply(q, k, v, segment_ids, opts)
