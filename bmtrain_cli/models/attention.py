"""Attention maths: the mask/bias from segment ids (padding and packed rows), and the attention core.

Mask semantics (shared with the data loader): attention_mask is an int tensor [b, s]; 0 = padding,
k > 0 = segment id. A query attends to keys at the same or an earlier index that carry the same
segment id. Padding (segment 0) attends only to padding, so no row is ever empty and nothing real
ever sees padding.

What :func:`attend` receives as ``mask`` decides the kernel (``models.attention_choice.choose_kernel``):

- ``None``: plain causal attention. Training batches whose rows are right-padded single samples come
  this way with no mask at all (padding follows every real token and carries no loss, so no real query
  ever needs to be kept from a pad key; ``models.scoring.to_tensors`` drops their mask).
- an int tensor [b, s] of segment ids: block-diagonal causal attention (packed rows; left-padded
  prompts), never expanded to an s x s tensor.
- a float tensor [b or 1, heads or 1, q, k]: an additive bias (KV-cache decoding, a sliding window
  that bites, ALiBi, and static graphs), given to sdpa or to the eager reference.

Kernels: ``flash`` (Paddle's flash_attention, GPU fp16/bf16, causal), ``flash_varlen``
(flash_attn_unpadded over cu_seqlens, GPU fp16/bf16, segment ids), ``cpu_fused`` (our C++/OpenMP kernel,
ops/fused_attention.py over kernels/cpu/attention_cpu.cc: causal or segment ids, fp32/fp64 on a CPU; it
keeps only the per-query log-sum-exp and recomputes the probabilities in the backward, so memory grows
linearly with the sequence; used on a CPU whenever the model's op set carries it, i.e. ``kernels``
custom or auto with the extension built), ``blocked`` (exact attention one query block at a time in
Paddle ops with a custom backward, also linear in memory: on a CPU without the fused kernel above
``DENSE_MAX_SEQ`` tokens), ``grouped_mask`` (an additive mask on a CPU in dynamic mode: matmul + softmax with the query heads of
each KV head stacked, K/V not repeated; Paddle's sdpa takes several times longer there for one decoding
query), ``sdpa_causal``, ``sdpa_mask`` (Paddle's scaled_dot_product_attention without
/ with an additive mask; on a GPU in fp32, on GPUs older than compute capability 8.0, for head_dim > 256
and for FA3 calls with training=False, Paddle's sdpa picks its own flash / memory-efficient / math kernel) and ``eager`` (matmul + softmax in fp32).
K/V arrive with their own number of heads (grouped-query attention): flash, flash_varlen, cpu_fused, sdpa
and blocked take fewer KV heads than query heads as they are; only the eager reference repeats them.
``model_config.kernels: reference`` (and ``paddle``) keep the pure-Paddle kernels.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Protocol, Tuple

import paddle
import paddle.nn.functional as F

from bmtrain_cli.models.attention_choice import IMPLEMENTATIONS, ScoreRule, choose_kernel
from bmtrain_cli.models.blocked_attention import allowed_keys, blocked_attention

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionCore",
    "ContextShard",
    "SegmentIds",
    "attend",
    "batch_segments",
    "blocked_attention",
    "build_bias",
    "cu_seqlens",
    "eager_attention",
    "grouped_attention",
]


class AttentionCore(Protocol):
    """A fused causal attention core in the model's layout (ops.fused_attention.fused_attention):
    q [b, s, h, d], k/v [b, s, kv_heads, d], optional int segment ids [b, s] -> [b, s, h, d]."""

    def __call__(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        segment_ids: Optional[paddle.Tensor] = None,
    ) -> paddle.Tensor: ...


class ContextShard:
    """The mask of a rank's share of each sequence under context parallel: attention runs ``core`` (the
    context group's ring attention, parallel/ring_attention.py RingCore, or its all-to-all of heads,
    parallel/ulysses.py UlyssesCore) with the whole rows' segment ids [b, S] (None: plain causal rows) and
    the layer's sliding window (None: none)."""

    def __init__(self, core: Any, segment_ids: Optional[paddle.Tensor], window: Optional[int] = None) -> None:
        self.core = core
        self.segment_ids = segment_ids
        self.window = window

    def windowed(self, window: Optional[int]) -> ContextShard:
        """This shard for a layer with sliding window ``window`` (None: itself)."""
        return self if window is None else ContextShard(self.core, self.segment_ids, window)


def build_bias(
    seg_q: Optional[paddle.Tensor],
    seg_k: Optional[paddle.Tensor],
    q_len: int,
    k_len: int,
    q_offset: int,
    dtype: Any,
    sliding_window: Optional[int] = None,
    alibi: Optional[paddle.Tensor] = None,
) -> paddle.Tensor:
    """Additive attention bias [b or 1, heads or 1, q_len, k_len] in ``dtype``.

    Query i sits at absolute index ``q_offset + i`` (non-zero while decoding with a KV cache);
    ``alibi`` holds per-head slopes [heads] and adds slope * (key index - query index)
    (equal, under softmax, to Baichuan's slope * key position).
    """
    allowed = allowed_keys(seg_q, seg_k, q_len, k_len, q_offset, sliding_window)
    q_idx = paddle.arange(q_len, dtype="int64").unsqueeze(-1) + q_offset
    k_idx = paddle.arange(k_len, dtype="int64").unsqueeze(0)
    dtype = dtype_name(dtype)
    neg = paddle.finfo(getattr(paddle, dtype)).min
    bias = paddle.where(
        allowed, paddle.zeros([1], dtype="float32"), paddle.full([1], neg, dtype="float32")
    ).unsqueeze(1)  # [b, 1, q, k]
    if alibi is not None:
        rel = (k_idx - q_idx).astype("float32")  # [q, k]
        bias = bias + alibi.astype("float32").reshape([1, -1, 1, 1]) * rel.unsqueeze(0).unsqueeze(0)
        bias = paddle.maximum(bias, paddle.full([1], neg, dtype="float32"))
    return bias.astype(dtype)


def dtype_name(dtype: Any) -> str:
    """'float32' for paddle.float32, 'float32', or a numpy dtype."""
    return str(dtype).replace("paddle.", "")


def repeat_kv(x: paddle.Tensor, n_rep: int) -> paddle.Tensor:
    """[b, s, kv_heads, d] -> [b, s, kv_heads * n_rep, d]; query head j uses kv head j // n_rep."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x.unsqueeze(3).expand([b, s, h, n_rep, d]).reshape([b, s, h * n_rep, d])


def soft_cap(x: paddle.Tensor, cap: Optional[float]) -> paddle.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capping of attention scores and logits); x unchanged for None."""
    return x if cap is None else paddle.tanh(x / cap) * cap


def eager_attention(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    bias: Optional[paddle.Tensor],
    scale: float,
    softcap: Optional[float] = None,
) -> paddle.Tensor:
    """Exact reference: q [b, sq, h, d], k/v [b, sk, h, d] -> [b, sq, h, d]; softmax in fp32, the scores
    soft-capped before the mask where ``softcap`` is set."""
    qt, kt, vt = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = soft_cap(paddle.matmul(qt, kt, transpose_y=True).astype("float32") * scale, softcap)
    if bias is None:
        sq, sk = scores.shape[-2], scores.shape[-1]
        bias = build_bias(None, None, sq, sk, sk - sq, "float32")
    scores = scores + bias.astype("float32")
    probs = F.softmax(scores, axis=-1).astype(q.dtype)
    return paddle.matmul(probs, vt).transpose([0, 2, 1, 3])


def grouped_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: paddle.Tensor, scale: float
) -> paddle.Tensor:
    """q [b, sq, h, d] over k/v [b, sk, kv_heads, d] with an additive ``bias`` [b or 1, h or 1, sq, sk]:
    the rep query heads of a KV head stacked on the query axis, so K/V are used as they are (never
    repeated); softmax in fp32. The ``grouped_mask`` kernel (KV-cache decoding on a CPU)."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    rep = h // kvh
    if sq == 1:  # one decoding query: [b, 1, h, d] is already [b, kv_heads, rep, d], no transpose needed
        qg = q.reshape([b, kvh, rep, d])
    else:
        qg = q.reshape([b, sq, kvh, rep, d]).transpose([0, 2, 3, 1, 4]).reshape([b, kvh, rep * sq, d])
    scores = paddle.matmul(qg, k.transpose([0, 2, 1, 3]), transpose_y=True)
    scores = _fp32(scores).reshape([b, kvh, rep, sq, sk]) * scale
    if bias.shape[1] == 1:
        scores = scores + _fp32(bias).unsqueeze(1)
    else:
        scores = scores + _fp32(bias).reshape([bias.shape[0], kvh, rep, sq, sk])
    probs = F.softmax(scores, axis=-1).astype(q.dtype).reshape([b, kvh, rep * sq, sk])
    out = paddle.matmul(probs, v.transpose([0, 2, 1, 3]))  # [b, kv_heads, rep * sq, d]
    if sq == 1:
        return out.reshape([b, 1, h, d])
    return out.reshape([b, kvh, rep, sq, d]).transpose([0, 3, 1, 2, 4]).reshape([b, sq, h, d])


def _fp32(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.dtype == paddle.float32 else t.astype("float32")


# ---------------------------------------------------------------------------------------------------
# the choice and the dispatch


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and "gpu" in str(paddle.get_device())


_CAPABILITY: List[Tuple[int, int]] = []


def gpu_capability() -> Tuple[int, int]:
    """The current GPU's compute capability (read once per process)."""
    if not _CAPABILITY:
        major, minor = paddle.device.cuda.get_device_capability()
        _CAPABILITY.append((int(major), int(minor)))
    return _CAPABILITY[0]


def flash_version(flags: Any) -> int:
    """The flash-attention version Paddle's flash_attention runs for these flag values (as it decides:
    FLAGS_cudnn_deterministic forces 2, else FLAGS_flash_attn_version)."""
    if flags.get("FLAGS_cudnn_deterministic"):
        return 2
    return int(flags.get("FLAGS_flash_attn_version", 2) or 2)


def _gpu_flash_version() -> int:
    try:
        flags = paddle.get_flags(["FLAGS_flash_attn_version", "FLAGS_cudnn_deterministic"])
    except ValueError:  # a build without the FA3 flag
        return 2
    return flash_version(flags)


class SegmentIds:
    """The int64 segment ids [b, s] of one batch and their cu_seqlens, computed at most once however
    many layers ask (``paddle.nonzero`` syncs the device with the host): the model builds one per batch
    at its entry on a GPU (:func:`batch_segments`) and every layer, recomputed forwards included (fleet's
    recompute passes non-tensor arguments through as they are), reads the same offsets."""

    ndim = 2

    def __init__(self, ids: paddle.Tensor) -> None:
        self.ids = ids
        self._cu: Optional[paddle.Tensor] = None
        self.computed = 0  # how many times the offsets were computed (0 or 1)

    def cu_seqlens(self) -> paddle.Tensor:
        if self._cu is None:
            self._cu = cu_seqlens(self.ids)
            self.computed += 1
        return self._cu


def batch_segments(mask: paddle.Tensor, on_gpu: Optional[bool] = None) -> Any:
    """What the layers get for the attention mask's segment ids: a :class:`SegmentIds` on a GPU in
    dynamic mode (where flash_varlen needs the offsets), the int64 tensor elsewhere. Memoised on
    ``mask`` so that the layers of a pipeline stage, which each receive the same mask tensor, share one."""
    gpu = _on_gpu() if on_gpu is None else on_gpu
    if not gpu or not paddle.in_dynamic_mode():
        return mask.astype("int64")
    held = getattr(mask, "_bmt_segments", None)
    if held is None:
        held = SegmentIds(mask.astype("int64"))
        mask._bmt_segments = held
    return held


def mask_kind(mask: Any) -> str:
    """'causal' (None), 'segments' (int [b, s] segment ids, or SegmentIds) or 'bias' (additive float mask)."""
    if mask is None:
        return "causal"
    return "segments" if mask.ndim == 2 else "bias"


def cu_seqlens(segment_ids: paddle.Tensor) -> paddle.Tensor:
    """int32 [n + 1] offsets of the n runs of equal segment id in the flattened [b, s] ids (a run never
    crosses a row): the sequences flash_attn_unpadded sees when the rows are laid end to end."""
    b, s = segment_ids.shape
    flat = segment_ids.reshape([-1])
    change = paddle.concat([paddle.ones([1], dtype="bool"), flat[1:] != flat[:-1]])
    row_start = (paddle.arange(b * s, dtype="int64") % s) == 0
    starts = paddle.nonzero(paddle.logical_or(change, row_start)).reshape([-1])
    return paddle.concat([starts, paddle.full([1], b * s, dtype="int64")]).astype("int32")


def _flash_varlen(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, cu: paddle.Tensor, training: bool
) -> paddle.Tensor:
    """Paddle's flash_attn_unpadded over the rows' segments (``cu``: their cumulative lengths)."""
    from paddle.nn.functional.flash_attention import flash_attn_unpadded

    b, s, h, d = q.shape
    out, _ = flash_attn_unpadded(
        q.reshape([b * s, h, d]),
        k.reshape([b * s, k.shape[2], d]),
        v.reshape([b * s, v.shape[2], d]),
        cu,
        cu,
        s,
        s,
        float(d) ** -0.5,
        causal=True,
        training=training,
    )
    return out.reshape([b, s, h, d])


def attend(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    mask: Any,
    implementation: str = "auto",
    training: bool = False,
    cpu_kernel: Optional[AttentionCore] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> paddle.Tensor:
    """Attention of q [b, sq, heads, d] over k/v [b, sk, kv_heads, d] (kv_heads divides heads; K/V are
    not repeated). ``mask``: None (causal, the query block at the end of the keys), int segment ids
    [b, s] (or a :class:`SegmentIds` holding them with their offsets), or an additive float bias; see the
    module docstring. ``cpu_kernel``: the fused CPU core of the model's op set (``OpSet.attention``; None where our kernels are not in use). ``window``: a
    sliding window the mask does not hold (a bias holds its own); ``softcap``: the scores become
    softcap * tanh(scores / softcap) before the mask (Gemma 2), which only the blocked and the eager
    kernels compute."""
    if isinstance(mask, ContextShard):  # the context group's core; ``whole``: this attention over whole rows
        whole = functools.partial(
            attend, implementation=implementation, training=training, cpu_kernel=cpu_kernel
        )
        return mask.core(q, k, v, mask.segment_ids, whole, ScoreRule(mask.window, softcap))
    held = mask if isinstance(mask, SegmentIds) else None
    if held is not None:
        mask = held.ids
    kind = mask_kind(mask)
    if kind == "causal" and q.shape[1] != k.shape[1]:
        mask, kind = build_bias(None, None, q.shape[1], k.shape[1], k.shape[1] - q.shape[1], q.dtype), "bias"
    half = q.dtype in (paddle.float16, paddle.bfloat16)
    static = not paddle.in_dynamic_mode()
    on_gpu = _on_gpu()
    kernel, _ = choose_kernel(
        kind,
        implementation,
        half,
        on_gpu,
        static,
        None if static else k.shape[1],
        cpu_kernel is not None,
        capability=gpu_capability() if on_gpu else None,
        head_dim=q.shape[-1],
        fa_version=_gpu_flash_version() if on_gpu and half else 2,
        training=training,
        softcap=softcap is not None,
    )
    n_rep = q.shape[2] // k.shape[2]
    if kernel == "cpu_fused":
        assert cpu_kernel is not None  # choose_kernel picks cpu_fused only when there is one
        return cpu_kernel(q, k, v, None if kind == "causal" else mask)
    if kernel == "flash":
        from paddle.nn.functional.flash_attention import flash_attention

        return flash_attention(q, k, v, causal=True, training=training)[0]
    if kernel == "flash_varlen":
        return _flash_varlen(q, k, v, held.cu_seqlens() if held is not None else cu_seqlens(mask), training)
    if kernel == "blocked":
        seg = None if kind == "causal" else mask.astype("int64")
        return blocked_attention(q, k, v, seg, window=window, softcap=softcap)
    if kind == "segments" or (kind == "causal" and window is not None):
        seg = None if kind == "causal" else mask
        mask = build_bias(seg, seg, q.shape[1], k.shape[1], 0, q.dtype, window)
    if kernel == "sdpa_causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, training=training)
    if kernel == "grouped_mask":
        return grouped_attention(q, k, v, mask, float(q.shape[-1]) ** -0.5)
    if kernel == "sdpa_mask":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.astype(q.dtype), training=training)
    scale = float(q.shape[-1]) ** -0.5
    return eager_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask, scale, softcap)
