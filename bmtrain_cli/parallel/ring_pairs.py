"""Ring attention with one kernel call per chunk pair (parallel/ring_attention.py's fast paths).

A pair kernel attends a query chunk [b, c, h, d] to a key chunk [b, c, hk, d] in the model's layout, every
head at once (grouped-query: K/V keep their heads), causal on the diagonal pair and fully visible before
it, and returns the chunk's output with its per-query log-sum-exp [b, h, c]. Its backward takes the merged
log-sum-exp of the whole attention (and D = rowsum(dO * O) or O itself) and returns that pair's share of
dQ, dK, dV (the FlashAttention-2 recurrences against the global statistics), which the ring sums.

A layer's sliding window skips the chunk pairs whose keys all lie outside it (:func:`pair_list`) and reaches
the kernel of a pair it cuts as (window, offset) (:data:`Window`); soft-capped scores (Gemma 2) reach every
pair's kernel as its cap.

- :class:`FusedPairs`: our fused CPU kernel (ops/fused_attention.py attention_pair_*), float32/float64, with
  the query chunk's and the key chunk's segment ids for packed rows, the window and the soft cap.
- :class:`FlashPairs`: Paddle's flash attention on a GPU (``_C_ops.flash_attn`` returns the log-sum-exp,
  ``_C_ops.flash_attn_grad`` takes the merged output and log-sum-exp), fp16/bf16 rows without segment ids,
  a window or a soft cap (FA2's flash_attn takes none).

:func:`pair_kernel` picks one for a call, or None: the ring then attends in blocks of Paddle ops (the
reference: on a CPU without our fused kernel, ``kernels: paddle``/``reference`` or no build; on a GPU
packed rows, fp32, a sliding window shorter than the rows, soft-capped scores, or what flash attention
refuses). The first rank
of a context group says once on stderr which path it runs, and why where it falls back to Paddle ops.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import paddle

from bmtrain_cli.models.attention_choice import ScoreRule, ring_pair_kernel
from bmtrain_cli.ops.fused_attention import Pair, attention_pair_backward, attention_pair_forward

_LOGGED: set = set()  # the paths this process has reported

Segments = Optional[Tuple[paddle.Tensor, paddle.Tensor]]
# a chunk pair's sliding window (window, offset): query i, offset positions after key 0 in the sequence,
# sees only the keys j with i + offset - j < window; None where no key of the pair lies outside it
Window = Optional[Tuple[int, int]]


def pair_list(
    q_chunks: Tuple[int, int], k_chunks: Tuple[int, int], c: int = 0, window: Optional[int] = None
) -> List[Tuple[int, int, bool]]:
    """(query slot, key slot, causal) of the chunk pairs with something visible: a key chunk before the
    query chunk is fully visible, the same chunk causal, a later one not at all; with a sliding ``window``
    (chunks of ``c`` tokens) neither is a key chunk whose nearest key lies ``window`` or more positions
    before the query chunk's first query."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            nearest = max(0, (qc - kc - 1) * c + 1)
            if kc <= qc and (window is None or nearest < window):
                out.append((qi, ki, kc == qc))
    return out


def chunks_of(degree: int, rank: int) -> Tuple[int, int]:
    """The sequence chunks rank ``rank`` of a ring of ``degree`` holds: its front and its back."""
    return rank, 2 * degree - 1 - rank


def merge(acc: Optional[Tuple[Any, Any]], o: paddle.Tensor, lse: paddle.Tensor) -> Tuple[Any, Any]:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exp
    (``lse`` has ``o``'s shape without its last axis)."""
    if acc is None:
        return o, lse
    prev_o, prev_lse = acc
    new = paddle.logaddexp(prev_lse, lse)
    merged = prev_o * paddle.exp(prev_lse - new).unsqueeze(-1) + o * paddle.exp(lse - new).unsqueeze(-1)
    return merged, new


class FusedPairs:
    """The fused CPU attention kernel per chunk pair."""

    name = "the fused CPU attention kernel per chunk pair"
    needs_out = False  # its backward takes D = rowsum(dO * O), not O

    def forward(self, pair: Pair) -> Tuple[paddle.Tensor, paddle.Tensor]:
        return attention_pair_forward(pair)

    def backward(
        self, pair: Pair, stats: Dict[str, Any]
    ) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        lse, delta = stats["lse"].astype(pair.q.dtype), stats["delta"].astype(pair.q.dtype)
        return attention_pair_backward(pair, lse, delta, stats["dout"])


class FlashPairs:
    """Paddle's flash attention per chunk pair (GPU, fp16/bf16, no segment ids). Its log-sum-exp may be
    padded past the queries (``width``): the backward pads the merged one the same way."""

    name = "Paddle's flash attention per chunk pair"
    needs_out = True  # its backward takes O (and computes D itself)

    def __init__(self) -> None:
        self.seed: Optional[paddle.Tensor] = None
        self.width = 0

    def forward(self, pair: Pair) -> Tuple[paddle.Tensor, paddle.Tensor]:
        from paddle import _C_ops

        _flash_takes(pair)
        # (q, k, v, fixed_seed_offset, attn_mask, dropout, causal, return_softmax, is_test, rng_name)
        q, k, v, causal = pair.q, pair.k, pair.v, pair.causal
        out, _, lse, seed = _C_ops.flash_attn(q, k, v, None, None, 0.0, causal, False, False, "")  # type: ignore[arg-type]
        self.seed, self.width = seed, int(lse.shape[-1])
        return out, lse[:, :, : pair.q.shape[1]]

    def backward(
        self, pair: Pair, stats: Dict[str, Any]
    ) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        from paddle import _C_ops

        _flash_takes(pair)
        lse = stats["lse"].astype("float32")
        if self.width > lse.shape[-1]:
            lse = paddle.concat(
                [lse, paddle.zeros([*lse.shape[:2], self.width - lse.shape[-1]], "float32")], -1
            )
        q, k, v, causal = pair.q, pair.k, pair.v, pair.causal
        # (q, k, v, out, softmax_lse, seed_offset, attn_mask, out_grad, dropout, causal)
        return _C_ops.flash_attn_grad(q, k, v, stats["out"], lse, self.seed, None, stats["dout"], 0.0, causal)


def _flash_takes(pair: Pair) -> None:
    if pair.window or pair.softcap or pair.segments is not None:
        raise ValueError(
            "Paddle's flash_attn takes no sliding window, soft cap or segment ids: models/attention_choice."
            "ring_pair_kernel gives such layers and rows the blocks of Paddle ops"
        )


class _Chunks:
    """One call's chunks in the model's layout: q [b, 2c, h, d] as two query slots, a K/V pair [2, b, 2c,
    hk, d] (what travels) as two key slots, the rows' segment ids [b, S] cut by sequence chunk, and the
    layer's sliding window (``rule.window``; None: every earlier key) and soft cap (``rule.softcap``)."""

    def __init__(self, q: paddle.Tensor, seg: Optional[paddle.Tensor], ring: Any, rule: ScoreRule) -> None:
        self.c = q.shape[1] // 2
        self.seg = seg
        self.window = rule.window
        self.softcap = 0.0 if rule.softcap is None else float(rule.softcap)
        self.scale = float(q.shape[-1]) ** -0.5
        self.acc = paddle.float64 if q.dtype == paddle.float64 else paddle.float32
        self.q_chunks = chunks_of(ring.degree, ring.rank)

    def slot(self, x: paddle.Tensor, i: int) -> paddle.Tensor:
        return x[:, i * self.c : (i + 1) * self.c].contiguous()

    def segments(self, qc: int, kc: int) -> Segments:
        """The segment ids of sequence chunks qc (the queries) and kc (the keys), or None."""
        if self.seg is None:
            return None
        q_ids, k_ids = (self.seg[:, x * self.c : (x + 1) * self.c].contiguous() for x in (qc, kc))
        return q_ids, k_ids

    def pair(self, q: paddle.Tensor, kv: paddle.Tensor, qc: int, kc: int, ki: int, causal: bool) -> Pair:
        """The kernel call of query chunk ``q`` (sequence chunk qc) and key slot ``ki`` (sequence chunk kc) of
        the K/V held."""
        window, offset = self.pair_window(qc, kc) or (0, 0)
        k, v = self.slot(kv[0], ki), self.slot(kv[1], ki)
        return Pair(q, k, v, self.segments(qc, kc), causal, self.scale, window, offset, self.softcap)

    def pair_window(self, qc: int, kc: int) -> Window:
        """The window of sequence chunks qc (the queries) and kc (the keys), or None where it holds every
        key of the pair (its farthest key, (qc - kc + 1) c - 1 positions back, lies inside)."""
        if self.window is None or (qc - kc + 1) * self.c - 1 < self.window:
            return None
        return self.window, (qc - kc) * self.c

    def steps(self, ring: Any, kv: paddle.Tensor) -> Any:
        """(key chunks, K/V held, pairs) of each step round the ring; the next K/V are exchanged with the
        neighbours before a step computes (as the Paddle-op blocks do)."""
        for t in range(ring.degree):
            k_chunks = chunks_of(ring.degree, (ring.rank - t) % ring.degree)
            incoming = ring.exchange([kv]) if t < ring.degree - 1 else None
            yield k_chunks, kv, pair_list(self.q_chunks, k_chunks, self.c, self.window)
            if incoming is not None:
                kv = incoming[0]


def pair_forward(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    seg: Optional[paddle.Tensor],
    ring: Any,
    kernel: Any,
    rule: ScoreRule = ScoreRule(),
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The ring's forward, one ``kernel`` call per chunk pair (none for a pair outside the sliding window
    of ``rule``): the output [b, 2c, h, d] (q's dtype) and the merged log-sum-exp [b, 2c, h] (float32,
    float64 for float64 rows)."""
    ch = _Chunks(q, seg, ring, rule)
    qs = [ch.slot(q, i) for i in range(2)]
    acc: Dict[int, Tuple[Any, Any]] = {}
    for k_chunks, kv, pairs in ch.steps(ring, paddle.stack([k, v])):
        for qi, ki, causal in pairs:
            o, lse = kernel.forward(ch.pair(qs[qi], kv, ch.q_chunks[qi], k_chunks[ki], ki, causal))
            acc[qi] = merge(acc.get(qi), o.astype(ch.acc), lse.astype(ch.acc).transpose([0, 2, 1]))
    out = paddle.concat([acc[0][0], acc[1][0]], axis=1).astype(q.dtype)
    return out, paddle.concat([acc[0][1], acc[1][1]], axis=1)


def pair_backward(
    saved: Tuple[Any, ...], ring: Any, kernel: Any, dout: paddle.Tensor, rule: ScoreRule = ScoreRule()
) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """The ring's backward, one ``kernel`` call per chunk pair; ``saved``: (q, k, v, out, lse, seg) of
    :func:`pair_forward`. Each K/V's gradient accumulators travel with it and come home after the last
    step."""
    q, k, v, out, lse, seg = saved
    ch = _Chunks(q, seg, ring, rule)
    qs = [ch.slot(q, i) for i in range(2)]
    delta = (dout.astype(ch.acc) * out.astype(ch.acc)).sum(axis=-1)  # D_i = dO_i . O_i, [b, 2c, h]
    stats: List[Dict[str, Any]] = []
    for i in range(2):
        stats.append({"dout": ch.slot(dout, i), "out": ch.slot(out, i) if kernel.needs_out else None})
        stats[i]["lse"] = ch.slot(lse, i).transpose([0, 2, 1]).contiguous()
        stats[i]["delta"] = ch.slot(delta, i).transpose([0, 2, 1]).contiguous()
    dqs = [paddle.zeros(qs[0].shape, dtype=ch.acc) for _ in range(2)]
    dk = paddle.zeros(k.shape, dtype=ch.acc)
    dv = paddle.zeros(v.shape, dtype=ch.acc)
    for k_chunks, kv, pairs in ch.steps(ring, paddle.stack([k, v])):
        for qi, ki, causal in pairs:
            pair = ch.pair(qs[qi], kv, ch.q_chunks[qi], k_chunks[ki], ki, causal)
            dq_p, dk_p, dv_p = kernel.backward(pair, stats[qi])
            dqs[qi] += dq_p.astype(ch.acc)
            keys = slice(ki * ch.c, (ki + 1) * ch.c)
            dk[:, keys] += dk_p.astype(ch.acc)
            dv[:, keys] += dv_p.astype(ch.acc)
        # the accumulators go on with the K/V they belong to; after the last step, home to their owner
        dk, dv = ring.exchange([dk, dv])
    dq = paddle.concat(dqs, axis=1).astype(q.dtype)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def pair_kernel(
    q: paddle.Tensor,
    seg: Optional[paddle.Tensor],
    fused: bool,
    report: bool = False,
    rule: ScoreRule = ScoreRule(),
) -> Any:
    """The pair kernel for a ring call with queries ``q`` [b, 2c, h, d] (``seg``: the rows' segment ids or
    None; ``fused``: the model's op set carries our fused CPU attention; ``rule``: the layer's score rule,
    its window shorter than the rows or None), or None for Paddle-op blocks, as
    models/attention_choice.ring_pair_kernel decides. ``report``: say on stderr which path runs (once per
    path and process)."""
    gpu = not q.place.is_cpu_place()
    capability = None
    if gpu:
        from bmtrain_cli.models.attention import gpu_capability

        capability = gpu_capability()
    dtype = str(q.dtype).replace("paddle.", "")
    name, why = ring_pair_kernel(dtype, gpu, seg is not None, fused, capability, q.shape[-1], rule)
    kernel: Any = {"flash": FlashPairs, "cpu_fused": FusedPairs}[name]() if name else None
    if report:
        _report_once(kernel, why)
    return kernel


def _report_once(kernel: Any, why: str) -> None:
    text = kernel.name if kernel is not None else f"blocks of Paddle ops ({why})"
    if text not in _LOGGED:
        _LOGGED.add(text)
        print(f"ring attention: {text}", file=sys.stderr, flush=True)
