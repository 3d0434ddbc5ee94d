"""Ring attention in blocks of Paddle ops (parallel/ring_attention.py's reference path: ``kernels:
reference``, builds without our kernels, and calls no pair kernel takes, parallel/ring_pairs.py).

Queries and keys are both taken in blocks of ``block`` tokens, so the transient scores of one block pair
(and their probabilities and gradients) do not grow with the sequence or the chunk. K/V keep their own
number of heads (grouped-query attention): the query heads of a KV head are stacked on the query axis.
A sliding window skips the block pairs whose keys all lie outside it and masks those it cuts. Soft-capped
scores (Gemma 2: cap * tanh(s / cap) before the mask) are capped block by block: the cap acts on each score
alone, so the blocks' partial softmaxes still merge exactly by their log-sum-exp; the backward multiplies
dS by the cap's derivative 1 - tanh^2.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import paddle

from bmtrain_cli.models.attention_choice import ScoreRule
from bmtrain_cli.parallel.ring_pairs import chunks_of, merge, pair_list

# a masked score: finite, so that a query that sees no key of a chunk pair gets a finite log-sum-exp whose
# weight in the merge (and whose probabilities in the backward) underflow to exactly zero
_MASKED = -1e30


class _Layout:
    """Shapes and per-block masks of one call: q [b, 2c, h, d] and k/v [b, 2c, hk, d] on every rank. Queries
    are grouped by KV head, token-major: row t * rep + j of [b, hk, c * rep, d] is token t, query head j of
    the KV head; a block of ``block`` tokens of a query chunk is a contiguous row range. ``rule``: the
    layer's sliding window on the tokens' places in the whole rows and the scaled scores' soft cap."""

    def __init__(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        seg: Optional[paddle.Tensor],
        block: int,
        rule: ScoreRule = ScoreRule(),
    ) -> None:
        self.b, s2, self.h, self.d = q.shape
        self.hk = k.shape[2]
        self.rep = self.h // self.hk
        self.c = s2 // 2
        self.seg = seg
        self.scale = float(self.d) ** -0.5
        self.block = block
        self.window, self.softcap = rule.window, rule.softcap
        self.blocks = [(t, min(t + block, self.c)) for t in range(0, self.c, block)]

    def q_slot(self, x: paddle.Tensor, i: int) -> paddle.Tensor:
        """Slot i (0 front, 1 back) of a [b, 2c, heads, d] tensor as [b, hk, c * rep, d]."""
        part = x[:, i * self.c : (i + 1) * self.c]
        g = part.reshape([self.b, self.c, self.hk, self.rep, x.shape[-1]]).transpose([0, 2, 1, 3, 4])
        return g.reshape([self.b, self.hk, self.c * self.rep, x.shape[-1]])

    def ungroup(self, x: paddle.Tensor) -> paddle.Tensor:
        """[b, hk, c * rep, d] -> [b, c, h, d]."""
        g = x.reshape([self.b, self.hk, self.c, self.rep, self.d]).transpose([0, 2, 1, 3, 4])
        return g.reshape([self.b, self.c, self.h, self.d])

    def rows(self, t0: int, t1: int) -> slice:
        return slice(t0 * self.rep, t1 * self.rep)

    def key_blocks(self, t0: int, t1: int, causal: bool, gap: int) -> List[Tuple[int, int]]:
        """The key blocks (chunk-local token ranges) the query block [t0, t1) can see: all of a full pair,
        those up to t1 of a causal one, less those whose keys all lie outside the window (``gap``: how many
        positions the pair's query chunk starts after its key chunk)."""
        end = t1 if causal else self.c
        blocks = [(k0, min(k0 + self.block, end)) for k0 in range(0, end, self.block)]
        if self.window is None:
            return blocks
        return [(k0, k1) for k0, k1 in blocks if gap + t0 - (k1 - 1) < self.window]

    def pairs(self, q_chunks: Tuple[int, int], k_chunks: Tuple[int, int]) -> List[Tuple[int, int, bool]]:
        return pair_list(q_chunks, k_chunks, self.c, self.window)

    def scores(
        self, qb: paddle.Tensor, kc: paddle.Tensor, qc: int, kchunk: int, t0: int, k0: int, causal: bool
    ) -> Tuple[Any, Any]:
        """Masked fp32 scores [b, hk, n * rep, kl] of the query block starting at token t0 of chunk qc against
        the kl keys of chunk kchunk starting at token k0 (kc [b, hk, kl, d]), soft-capped before the mask,
        and the cap's derivative at each score (None without a cap)."""
        s = paddle.matmul(qb, kc, transpose_y=True).astype("float32") * self.scale
        slope = None
        if self.softcap is not None:
            t = paddle.tanh(s / self.softcap)
            s, slope = t * self.softcap, 1.0 - t * t
        n, kl = qb.shape[2] // self.rep, kc.shape[2]
        allowed = None
        gap = (qc - kchunk) * self.c  # a query's place in the row less a key's, past their chunk indices
        diagonal = causal and k0 + kl > t0 + 1  # some keys lie after some queries
        cut = self.window is not None and gap + t0 + n - 1 - k0 >= self.window  # some keys lie outside it
        if diagonal or cut:
            q_tok = paddle.arange(n * self.rep, dtype="int64") // self.rep + t0 + gap
            k_tok = paddle.arange(k0, k0 + kl, dtype="int64")
            back = q_tok.unsqueeze(1) - k_tok.unsqueeze(0)  # how many places each key lies before each query
            conds = ([back >= 0] if diagonal else []) + ([back < self.window] if cut else [])
            allowed = functools.reduce(paddle.logical_and, conds).unsqueeze(0)
        if self.seg is not None:
            sq = self.seg[:, qc * self.c + t0 : qc * self.c + t0 + n]
            if self.rep > 1:
                sq = paddle.repeat_interleave(sq, self.rep, axis=1)
            sk = self.seg[:, kchunk * self.c + k0 : kchunk * self.c + k0 + kl]
            same = sq.unsqueeze(-1) == sk.unsqueeze(1)  # [b, n * rep, kl]
            allowed = same if allowed is None else paddle.logical_and(allowed, same)
        if allowed is None:
            return s, slope
        return paddle.where(allowed.unsqueeze(1), s, paddle.full([1], _MASKED, dtype="float32")), slope


def _kv_layout(k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
    """k, v [b, 2c, hk, d] -> [2, b, hk, 2c, d]: what travels round the ring."""
    return paddle.stack([k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])])


def blocks_forward(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    seg: Optional[paddle.Tensor],
    ring: Any,
    block: int,
    rule: ScoreRule = ScoreRule(),
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The ring's forward: the output [b, 2c, h, d] and the per-query log-sum-exp of each query slot,
    stacked [2, b, hk, c * rep] (fp32)."""
    lay = _Layout(q, k, seg, block, rule)
    q_chunks = chunks_of(ring.degree, ring.rank)
    qgs = [lay.q_slot(q, i) for i in range(2)]
    acc: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
    kv = _kv_layout(k, v)
    for t in range(ring.degree):
        k_chunks = chunks_of(ring.degree, (ring.rank - t) % ring.degree)
        incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
        for qi, ki, causal in lay.pairs(q_chunks, k_chunks):
            gap = (q_chunks[qi] - k_chunks[ki]) * lay.c
            for bi, (t0, t1) in enumerate(lay.blocks):
                qb = qgs[qi][:, :, lay.rows(t0, t1)]
                for k0, k1 in lay.key_blocks(t0, t1, causal, gap):
                    keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                    kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                    s, _ = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
                    lse = paddle.logsumexp(s, axis=-1)
                    o = paddle.matmul(paddle.exp(s - lse.unsqueeze(-1)).astype(vc.dtype), vc)
                    acc[(qi, bi)] = merge(acc.get((qi, bi)), o.astype("float32"), lse)
        if incoming is not None:
            kv = incoming[0]
    nb = len(lay.blocks)
    outs = [paddle.concat([acc[(qi, bi)][0] for bi in range(nb)], axis=2) for qi in range(2)]
    lses = [paddle.concat([acc[(qi, bi)][1] for bi in range(nb)], axis=2) for qi in range(2)]
    out = paddle.concat([lay.ungroup(o) for o in outs], axis=1).astype(q.dtype)
    return out, paddle.stack(lses)


def blocks_backward(
    saved: Tuple[Any, ...],
    ring: Any,
    block: int,
    dout: paddle.Tensor,
    rule: ScoreRule = ScoreRule(),
) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """The ring's backward from ``saved`` = (q, k, v, out, lse, seg) of :func:`blocks_forward`: dq, dk, dv."""
    q, k, v, out, lse, seg = saved
    lay = _Layout(q, k, seg, block, rule)
    q_chunks = chunks_of(ring.degree, ring.rank)
    qgs = [lay.q_slot(q, i) for i in range(2)]
    dos = [lay.q_slot(dout, i) for i in range(2)]
    # D_i = sum_j P_ij dP_ij = dO_i . O_i
    deltas = [
        (dos[i].astype("float32") * lay.q_slot(out, i).astype("float32")).sum(axis=-1, keepdim=True)
        for i in range(2)
    ]
    dqs = [paddle.zeros(qgs[0].shape, dtype="float32") for _ in range(2)]
    kv = _kv_layout(k, v)
    dk = paddle.zeros(kv.shape[1:], dtype="float32")
    dv = paddle.zeros(kv.shape[1:], dtype="float32")
    for t in range(ring.degree):
        k_chunks = chunks_of(ring.degree, (ring.rank - t) % ring.degree)
        incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
        for qi, ki, causal in lay.pairs(q_chunks, k_chunks):
            gap = (q_chunks[qi] - k_chunks[ki]) * lay.c
            for t0, t1 in lay.blocks:
                rows = lay.rows(t0, t1)
                qb, dob = qgs[qi][:, :, rows], dos[qi][:, :, rows]
                for k0, k1 in lay.key_blocks(t0, t1, causal, gap):
                    keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                    kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                    s, slope = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
                    p = paddle.exp(s - lse[qi][:, :, rows].unsqueeze(-1))
                    del s
                    dv[:, :, keys] += paddle.matmul(p.astype(vc.dtype), dob, transpose_x=True).astype(
                        "float32"
                    )
                    dp = paddle.matmul(dob, vc, transpose_y=True).astype("float32")
                    ds = p * (dp - deltas[qi][:, :, rows]) * lay.scale
                    if slope is not None:  # through the cap: d(cap * tanh(x / cap)) = (1 - tanh^2) dx
                        ds = ds * slope
                    ds = ds.astype(q.dtype)
                    del p, dp, slope
                    dqs[qi][:, :, rows] += paddle.matmul(ds, kc).astype("float32")
                    dk[:, :, keys] += paddle.matmul(ds, qb, transpose_x=True).astype("float32")
        # the accumulators go on with the K/V they belong to; after the last step, home to their owner
        dk, dv = ring.exchange([dk, dv])
        if incoming is not None:
            kv = incoming[0]
    dq = paddle.concat([lay.ungroup(x) for x in dqs], axis=1).astype(q.dtype)
    dk = dk.transpose([0, 2, 1, 3]).astype(k.dtype)
    dv = dv.transpose([0, 2, 1, 3]).astype(v.dtype)
    return dq, dk, dv
