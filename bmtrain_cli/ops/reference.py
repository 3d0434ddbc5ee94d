"""Pure-Paddle reference implementations of the fused ops. Every kernel is tested against these."""

from __future__ import annotations

from typing import Optional, Tuple

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


def gated_delta_rule_recurrent(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    g: paddle.Tensor,
    beta: paddle.Tensor,
    state: paddle.Tensor,
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """The gated delta rule token by token (Gated DeltaNet, Qwen3.5's linear attention). Per head, with
    the state S [dk, dv]: S <- exp(g_t) S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t.

    q, k: [b, s, h, dk] (normalised and scaled by the caller); v: [b, s, h, dv]; g (log decay, <= 0) and
    beta: [b, s, h]; state: [b, h, dk, dv]. Returns (o [b, s, h, dv], the state after the last token)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * paddle.exp(g[:, t]).unsqueeze(-1).unsqueeze(-1)
        k_t = k[:, t].unsqueeze(-2)  # [b, h, 1, dk]
        delta = (v[:, t] - paddle.matmul(k_t, state).squeeze(-2)) * beta[:, t].unsqueeze(-1)
        state = state + paddle.matmul(k_t, delta.unsqueeze(-2), transpose_x=True)
        outs.append(paddle.matmul(q[:, t].unsqueeze(-2), state).squeeze(-2))
    return paddle.stack(outs, axis=1), state


def _chunked(x: paddle.Tensor, chunk: int, pad: int) -> paddle.Tensor:
    """[b, s, h, ...] -> [b, h, n, chunk, ...], zero-padded at the end to n * chunk positions."""
    x = x.transpose([0, 2, 1] + list(range(3, x.ndim)))
    if pad:
        x = paddle.concat([x, paddle.zeros([*x.shape[:2], pad, *x.shape[3:]], dtype=x.dtype)], axis=2)
    return x.reshape([x.shape[0], x.shape[1], -1, chunk, *x.shape[3:]])


def gated_delta_rule(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    g: paddle.Tensor,
    beta: paddle.Tensor,
    state: Optional[paddle.Tensor] = None,
    chunk: int = 64,
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """:func:`gated_delta_rule_recurrent` in chunks of ``chunk`` tokens, exact to it. Within a chunk the
    updates u_i = beta_i (v_i - S_i'^T k_i) solve one unit lower-triangular system (I + A) U = beta V -
    diag(beta G) K S0, A_ij = beta_i (G_i / G_j) k_i.k_j for j < i, G the cumulative decay; outputs and the
    next state are then matrix products. ``state`` None starts from zeros."""
    b, s, h, dk = q.shape
    pad = (-s) % chunk
    qc, kc, vc = (_chunked(x, chunk, pad) for x in (q, k, v))
    gc, bc = _chunked(g, chunk, pad), _chunked(beta, chunk, pad)  # [b, h, n, C]
    cum = paddle.cumsum(gc, axis=-1)
    lower = paddle.tril(paddle.ones([chunk, chunk], dtype="bool"))
    diff = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [.., i, j] = log(G_i / G_j)
    decay = paddle.exp(paddle.where(lower, diff, paddle.full_like(diff, float("-inf"))))
    kb = kc * bc.unsqueeze(-1)
    strict = paddle.matmul(kb, kc, transpose_y=True) * decay * (1.0 - paddle.eye(chunk, dtype=q.dtype))
    rhs = paddle.concat([vc * bc.unsqueeze(-1), kb * paddle.exp(cum).unsqueeze(-1)], axis=-1)
    solved = paddle.linalg.triangular_solve(strict, rhs, upper=False, unitriangular=True)
    u0, w = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    attn = paddle.matmul(qc, kc, transpose_y=True) * decay  # within the chunk, the diagonal included
    q_dec = qc * paddle.exp(cum).unsqueeze(-1)
    k_dec = kc * paddle.exp(cum[..., -1:] - cum).unsqueeze(-1)
    chunk_decay = paddle.exp(cum[..., -1]).unsqueeze(-1).unsqueeze(-1)  # [b, h, n, 1, 1]
    if state is None:
        state = paddle.zeros([b, h, dk, v.shape[-1]], dtype=q.dtype)
    outs = []
    for i in range(qc.shape[2]):
        u = u0[:, :, i] - paddle.matmul(w[:, :, i], state)
        outs.append(paddle.matmul(q_dec[:, :, i], state) + paddle.matmul(attn[:, :, i], u))
        state = state * chunk_decay[:, :, i] + paddle.matmul(k_dec[:, :, i], u, transpose_x=True)
    out = paddle.stack(outs, axis=2).reshape([b, h, -1, v.shape[-1]])[:, :, :s]
    return out.transpose([0, 2, 1, 3]), state
