"""Pure-Paddle reference implementations of the fused ops. Every kernel is tested against these."""

from __future__ import annotations

from typing import Tuple

import paddle
import paddle.nn.functional as F

# ``ignore_index: int = -100`` below is labels.IGNORE_INDEX spelled out: paddle.jit.to_static(full_graph=True)
# cannot resolve a module constant in a signature.


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """y = x / sqrt(mean(x^2, -1) + eps) * weight, computed in fp32 and cast back to x's dtype."""
    xf = x.astype("float32")
    y = xf * paddle.rsqrt(xf.pow(2).mean(axis=-1, keepdim=True) + eps)
    return y.astype(x.dtype) * weight


def _rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    half = x.shape[-1] // 2
    return paddle.concat([-x[..., half:], x[..., :half]], axis=-1)


def rotary(
    q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Rotary position embedding (Hugging Face "rotate half" convention).

    q: [batch, seq, q_heads, head_dim], k: [batch, seq, kv_heads, head_dim];
    cos, sin: [batch or 1, seq, head_dim] (per position, so packed rows with restarting positions work).
    """
    c = cos.unsqueeze(2)
    s = sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def rotary_interleaved(
    q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Rotary position embedding on interleaved pairs: dimensions 2i and 2i+1 turn by frequency i (the
    convention of ERNIE 4.5 and GLM-4). Shapes as :func:`rotary`; cos/sin hold each frequency twice (the
    first half is used)."""
    half = cos.shape[-1] // 2
    c = cos[..., :half].unsqueeze(2)
    s = sin[..., :half].unsqueeze(2)

    def turn(x: paddle.Tensor) -> paddle.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return paddle.stack([even * c - odd * s, odd * c + even * s], axis=-1).flatten(start_axis=3)

    return turn(q), turn(k)


def swiglu(gate: paddle.Tensor, up: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def cross_entropy_sum(
    logits: paddle.Tensor, labels: paddle.Tensor, ignore_index: int = -100
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(sum of token losses over non-ignored labels, number of non-ignored labels), in fp32.

    Paddle's F.cross_entropy(..., reduction="mean") divides by all tokens when ignore_index < 0, so the
    mean is left to the caller, who divides by a count gathered over the whole optimizer step.
    """
    logits = logits.reshape([-1, logits.shape[-1]]).astype("float32")
    labels = labels.reshape([-1])
    valid = labels != ignore_index
    safe = paddle.where(valid, labels, paddle.zeros_like(labels))
    # logsumexp - picked logit, not log_softmax: Paddle 3.3.1's CPU log_softmax takes ~40 s on [2040, 8000]
    picked = paddle.take_along_axis(logits, safe.unsqueeze(-1).astype("int64"), axis=-1).squeeze(-1)
    validf = valid.astype("float32")
    return ((paddle.logsumexp(logits, axis=-1) - picked) * validf).sum(), validf.sum()


def linear_cross_entropy(
    hidden: paddle.Tensor,
    weight: paddle.Tensor,
    labels: paddle.Tensor,
    ignore_index: int = -100,
    transpose_weight: bool = False,
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Loss of the LM head without the caller holding the logits: (loss sum, valid count).

    hidden: [tokens, hidden]; weight: [hidden, vocab] (Paddle Linear layout) or [vocab, hidden] with
    transpose_weight (tied embeddings); labels: [tokens]. The reference materialises the logits.
    """
    logits = paddle.matmul(hidden, weight, transpose_y=transpose_weight)
    return cross_entropy_sum(logits, labels, ignore_index)
