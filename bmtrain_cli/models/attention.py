"""Attention maths: the mask/bias from segment ids (padding and packed rows), and the attention core
with three implementations: Paddle's fused scaled_dot_product_attention, flash attention (GPU, half
precision, plain causal rows), and an exact eager fallback (matmul + softmax in fp32).

Mask semantics (shared with the data loader): attention_mask is an int tensor [b, s]; 0 = padding,
k > 0 = segment id. A query attends to keys at the same or an earlier index that carry the same
segment id. Padding (segment 0) attends only to padding, so no row is ever empty and nothing real
ever sees padding.
"""

from __future__ import annotations

from typing import Any, Optional

import paddle
import paddle.nn.functional as F

IMPLEMENTATIONS = ("auto", "sdpa", "flash", "eager")


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
    q_idx = paddle.arange(q_len, dtype="int64").unsqueeze(-1) + q_offset
    k_idx = paddle.arange(k_len, dtype="int64").unsqueeze(0)
    allowed = (k_idx <= q_idx).unsqueeze(0)  # [1, q, k]
    if sliding_window is not None:
        allowed = paddle.logical_and(allowed, (q_idx - k_idx < sliding_window).unsqueeze(0))
    if seg_q is not None:
        same = seg_q.unsqueeze(-1) == seg_k.unsqueeze(1)  # [b, q, k]
        allowed = paddle.logical_and(allowed, same)
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


def eager_attention(
    q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: Optional[paddle.Tensor], scale: float
) -> paddle.Tensor:
    """Exact reference: q [b, sq, h, d], k/v [b, sk, h, d] -> [b, sq, h, d]; softmax in fp32."""
    qt, kt, vt = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))
    scores = paddle.matmul(qt, kt, transpose_y=True).astype("float32") * scale
    if bias is None:
        sq, sk = scores.shape[-2], scores.shape[-1]
        bias = build_bias(None, None, sq, sk, sk - sq, "float32")
    scores = scores + bias.astype("float32")
    probs = F.softmax(scores, axis=-1).astype(q.dtype)
    return paddle.matmul(probs, vt).transpose([0, 2, 1, 3])


def _on_gpu() -> bool:
    return paddle.is_compiled_with_cuda() and "gpu" in str(paddle.get_device())


def attend(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    bias: Optional[paddle.Tensor],
    implementation: str = "auto",
    training: bool = False,
) -> paddle.Tensor:
    """Attention over [b, s, heads, d] tensors (k/v already repeated to the query heads).

    ``bias`` None means plain causal attention with the query block at the end of the keys.
    """
    scale = float(q.shape[-1]) ** -0.5
    impl = implementation
    if impl == "auto":
        half = q.dtype in (paddle.float16, paddle.bfloat16)
        impl = "flash" if (bias is None and half and _on_gpu()) else "sdpa"
    if impl == "flash":
        if bias is not None or not _on_gpu():
            # flash attention has no arbitrary-mask path and no CPU kernel for half precision
            impl = "sdpa"
        else:
            from paddle.nn.functional.flash_attention import flash_attention  # noqa: PLC0415

            out, _ = flash_attention(q, k, v, causal=True, training=training)
            return out
    if impl == "sdpa":
        if bias is None and q.shape[1] != k.shape[1]:
            bias = build_bias(None, None, q.shape[1], k.shape[1], k.shape[1] - q.shape[1], q.dtype)
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, training=training)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.astype(q.dtype), training=training)
    if impl == "eager":
        return eager_attention(q, k, v, bias, scale)
    raise ValueError(f"unknown attention implementation {implementation!r} (choose from {IMPLEMENTATIONS})")
