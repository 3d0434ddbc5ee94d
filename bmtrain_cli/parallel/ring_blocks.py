"""Ring attention in blocks of Paddle ops (parallel/ring_attention.py's reference path: ``kernels:
reference``, builds without our kernels, and calls no pair kernel takes, parallel/ring_pairs.py).

Queries and keys are both taken in blocks of ``block`` tokens, so the transient scores of one block pair
(and their probabilities and gradients) do not grow with the sequence or the chunk. K/V keep their own
number of heads (grouped-query attention): the query heads of a KV head are stacked on the query axis.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import paddle

from bmtrain_cli.parallel.ring_pairs import chunks_of, merge, pair_list

# a masked score: finite, so that a query that sees no key of a chunk pair gets a finite log-sum-exp whose
# weight in the merge (and whose probabilities in the backward) underflow to exactly zero
_MASKED = -1e30


class _Layout:
    """Shapes and per-block masks of one call: q [b, 2c, h, d] and k/v [b, 2c, hk, d] on every rank. Queries
    are grouped by KV head, token-major: row t * rep + j of [b, hk, c * rep, d] is token t, query head j of
    the KV head; a block of ``block`` tokens of a query chunk is a contiguous row range."""

    def __init__(self, q: paddle.Tensor, k: paddle.Tensor, seg: Optional[paddle.Tensor], block: int) -> None:
        self.b, s2, self.h, self.d = q.shape
        self.hk = k.shape[2]
        self.rep = self.h // self.hk
        self.c = s2 // 2
        self.seg = seg
        self.scale = float(self.d) ** -0.5
        self.block = block
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

    def key_blocks(self, t1: int, causal: bool) -> List[Tuple[int, int]]:
        """The key blocks (chunk-local token ranges) a query block ending at token t1 can see: all of a full
        pair, those up to t1 of a causal one."""
        end = t1 if causal else self.c
        return [(k0, min(k0 + self.block, end)) for k0 in range(0, end, self.block)]

    def scores(
        self, qb: paddle.Tensor, kc: paddle.Tensor, qc: int, kchunk: int, t0: int, k0: int, causal: bool
    ) -> Any:
        """Masked fp32 scores [b, hk, n * rep, kl] of the query block starting at token t0 of chunk qc against
        the kl keys of chunk kchunk starting at token k0 (kc [b, hk, kl, d])."""
        s = paddle.matmul(qb, kc, transpose_y=True).astype("float32") * self.scale
        n, kl = qb.shape[2] // self.rep, kc.shape[2]
        allowed = None
        if causal and k0 + kl > t0 + 1:  # a block pair on the diagonal: some keys lie after some queries
            q_tok = paddle.arange(n * self.rep, dtype="int64") // self.rep + t0
            k_tok = paddle.arange(k0, k0 + kl, dtype="int64")
            allowed = (k_tok.unsqueeze(0) <= q_tok.unsqueeze(1)).unsqueeze(0)
        if self.seg is not None:
            sq = self.seg[:, qc * self.c + t0 : qc * self.c + t0 + n]
            if self.rep > 1:
                sq = paddle.repeat_interleave(sq, self.rep, axis=1)
            sk = self.seg[:, kchunk * self.c + k0 : kchunk * self.c + k0 + kl]
            same = sq.unsqueeze(-1) == sk.unsqueeze(1)  # [b, n * rep, kl]
            allowed = same if allowed is None else paddle.logical_and(allowed, same)
        if allowed is None:
            return s
        return paddle.where(allowed.unsqueeze(1), s, paddle.full([1], _MASKED, dtype="float32"))


def _kv_layout(k: paddle.Tensor, v: paddle.Tensor) -> paddle.Tensor:
    """k, v [b, 2c, hk, d] -> [2, b, hk, 2c, d]: what travels round the ring."""
    return paddle.stack([k.transpose([0, 2, 1, 3]), v.transpose([0, 2, 1, 3])])


def blocks_forward(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, seg: Optional[paddle.Tensor], ring: Any, block: int
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The ring's forward: the output [b, 2c, h, d] and the per-query log-sum-exp of each query slot,
    stacked [2, b, hk, c * rep] (fp32)."""
    lay = _Layout(q, k, seg, block)
    q_chunks = chunks_of(ring.degree, ring.rank)
    qgs = [lay.q_slot(q, i) for i in range(2)]
    acc: Dict[Tuple[int, int], Tuple[Any, Any]] = {}
    kv = _kv_layout(k, v)
    for t in range(ring.degree):
        k_chunks = chunks_of(ring.degree, (ring.rank - t) % ring.degree)
        incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
        for qi, ki, causal in pair_list(q_chunks, k_chunks):
            for bi, (t0, t1) in enumerate(lay.blocks):
                qb = qgs[qi][:, :, lay.rows(t0, t1)]
                for k0, k1 in lay.key_blocks(t1, causal):
                    keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                    kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                    s = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
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
    saved: Tuple[Any, ...], ring: Any, block: int, dout: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """The ring's backward from ``saved`` = (q, k, v, out, lse, seg) of :func:`blocks_forward`: dq, dk, dv."""
    q, k, v, out, lse, seg = saved
    lay = _Layout(q, k, seg, block)
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
        for qi, ki, causal in pair_list(q_chunks, k_chunks):
            for t0, t1 in lay.blocks:
                rows = lay.rows(t0, t1)
                qb, dob = qgs[qi][:, :, rows], dos[qi][:, :, rows]
                for k0, k1 in lay.key_blocks(t1, causal):
                    keys = slice(ki * lay.c + k0, ki * lay.c + k1)
                    kc, vc = kv[0][:, :, keys], kv[1][:, :, keys]
                    s = lay.scores(qb, kc, q_chunks[qi], k_chunks[ki], t0, k0, causal)
                    p = paddle.exp(s - lse[qi][:, :, rows].unsqueeze(-1))
                    del s
                    dv[:, :, keys] += paddle.matmul(p.astype(vc.dtype), dob, transpose_x=True).astype(
                        "float32"
                    )
                    dp = paddle.matmul(dob, vc, transpose_y=True).astype("float32")
                    ds = (p * (dp - deltas[qi][:, :, rows]) * lay.scale).astype(q.dtype)
                    del p, dp
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
