"""Our fused kernels (kernels/) behind the OpSet signatures: thin checked wrappers and autograd ops.

Layers: the launchers (kernels/cpu, kernels/cuda; C ABI) <- the Paddle custom operators
(kernels/paddle/fused_ops.cc: shape/dtype/contiguity checks, grad ops) <- these wrappers (argument checks
with a clear ValueError, dtype alignment, contiguity) and, for the cross-entropies, PyLayers.

The fused linear + cross-entropy never holds the [tokens, vocab] logits: it walks over chunks of tokens,
computing each chunk's logits with a matmul, its loss and logits gradient with one fused kernel, and
folding that gradient straight into the hidden and weight gradients (when they are needed). Backward then
only scales those by the incoming gradient, so the matmul count equals the unfused version's.
"""

from __future__ import annotations

from typing import Optional, Tuple

import paddle
from paddle.autograd import PyLayer

from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.loss_chunks import chunk_tokens as lm_chunk_tokens

try:  # True while paddle.jit.to_static's SOT translator simulates the code (Paddle >= 3.0)
    from paddle.base.dygraph.base import in_sot_simulation_mode
except ImportError:  # pragma: no cover - older Paddle: only the AST translator, seen by in_dynamic_mode

    def in_sot_simulation_mode() -> bool:
        return False


# ``ignore_index: int = -100`` below is labels.IGNORE_INDEX spelled out: paddle.jit.to_static(full_graph=True)
# cannot resolve a module constant in a signature.
_FLOATS = (paddle.float32, paddle.float64, paddle.float16, paddle.bfloat16)


@paddle.jit.not_to_static  # to_static(full_graph=True) must call the loader, not translate it
def _ext():
    return load_extension()


def _on_cpu() -> bool:
    # The expected device, not ``t.place``: a tensor's place is not readable while paddle.jit.to_static
    # traces the model (SOT), and the checks must work in both modes.
    return not paddle.is_compiled_with_cuda() or paddle.get_device() == "cpu"


def _traced() -> bool:
    """Whether paddle.jit.to_static is tracing this call (SOT simulation or a static-graph program)."""
    return in_sot_simulation_mode() or not paddle.in_dynamic_mode()


@paddle.jit.not_to_static
def _dims_differ(a, b) -> bool:
    """Whether two shapes differ; a dimension unknown while to_static traces (-1, or a shape tensor under
    full_graph=True) matches anything."""

    def known(x) -> bool:
        return isinstance(x, int) and x >= 0

    a, b = list(a), list(b)
    return len(a) != len(b) or any(known(x) and known(y) and x != y for x, y in zip(a, b))


def _need_float(name: str, op: str, t: paddle.Tensor) -> None:
    if t.dtype not in _FLOATS:
        raise ValueError(f"{op}: {name} must be a floating tensor, got {t.dtype}")
    if t.dtype not in (paddle.float32, paddle.float64) and _on_cpu():
        raise ValueError(
            f"{op}: {name} is {t.dtype} on CPU; the CPU kernels take float32/float64 "
            "(use kernels: reference, or fp32 on CPU)"
        )


def contiguous(t: paddle.Tensor) -> paddle.Tensor:
    """``t`` laid out densely, as the C++ launchers read it (a copy only when it is strided); the one
    definition for every wrapper of ops/ over our kernels."""
    if _traced():  # a static program's values are dense (and have no is_contiguous)
        return t
    return t if t.is_contiguous() else t.contiguous()


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """Fused RMSNorm over the last axis (same result as reference.rms_norm)."""
    _need_float("x", "rms_norm", x)
    if x.ndim < 1 or _dims_differ(weight.shape, [x.shape[-1]]):
        raise ValueError(
            f"rms_norm: weight must be [{x.shape[-1] if x.ndim else '?'}], got {list(weight.shape)}"
        )
    if weight.dtype != x.dtype:
        weight = weight.astype(x.dtype)
    y, _ = _ext().bmt_rms_norm(contiguous(x), contiguous(weight), float(eps))
    return y


def rotary(
    q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """Fused rotary embedding of q and k ("rotate half"); q, k: [b, s, h, d]; cos, sin: [b|1, s, d]."""
    _need_float("q", "rotary", q)
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            f"rotary: q and k must be [batch, seq, heads, head_dim], got {q.shape} and {k.shape}"
        )
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    b, s, _, d = q.shape
    if d % 2 or _dims_differ(k.shape[:2], [b, s]) or _dims_differ(k.shape[3:], [d]):
        raise ValueError(f"rotary: k {k.shape} does not match q {q.shape} (head_dim must be even)")
    if (
        cos.ndim != 3
        or _dims_differ(cos.shape[1:], [s, d])
        or (_dims_differ(cos.shape[:1], [1]) and _dims_differ(cos.shape[:1], [b]))
        or _dims_differ(sin.shape, cos.shape)
    ):
        raise ValueError(f"rotary: cos/sin must be [{b} or 1, {s}, {d}], got {cos.shape} and {sin.shape}")
    if k.dtype != q.dtype:
        k = k.astype(q.dtype)
    if cos.dtype != q.dtype:
        cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
    qo, ko = _ext().bmt_rotary(
        contiguous(q), contiguous(k), contiguous(cos), contiguous(sin), q.shape[2], k.shape[2]
    )
    return qo, ko


def swiglu(gate: paddle.Tensor, up: paddle.Tensor) -> paddle.Tensor:
    """Fused silu(gate) * up."""
    _need_float("gate", "swiglu", gate)
    if _dims_differ(gate.shape, up.shape):
        raise ValueError(f"swiglu: gate {gate.shape} and up {up.shape} must have the same shape")
    if up.dtype != gate.dtype:
        up = up.astype(gate.dtype)
    return _ext().bmt_swiglu(contiguous(gate), contiguous(up))


def _check_labels(op: str, labels: paddle.Tensor, rows: int) -> paddle.Tensor:
    labels = labels.reshape([-1])
    if _dims_differ(labels.shape, [rows]):
        raise ValueError(f"{op}: {labels.shape[0]} labels for {rows} rows")
    if labels.dtype != paddle.int64:
        labels = labels.astype("int64")
    return contiguous(labels)


def _logits_dtype(t: paddle.Tensor) -> paddle.dtype:
    return paddle.float64 if t.dtype == paddle.float64 else paddle.float32


class _CrossEntropySum(PyLayer):
    @staticmethod
    def forward(ctx, logits, labels, ignore_index):
        lf = logits.astype(_logits_dtype(logits))
        loss, dlogits = _ext().bmt_softmax_xent(contiguous(lf), labels, int(ignore_index))
        ctx.save_for_backward(dlogits)
        ctx.in_dtype = logits.dtype
        return loss.sum().astype("float32")  # the count is computed outside: no mark_non_differentiable

    @staticmethod
    def backward(ctx, grad_loss):
        (dlogits,) = ctx.saved_tensor()
        return (dlogits * grad_loss.astype(dlogits.dtype)).astype(ctx.in_dtype), None


def cross_entropy_sum(
    logits: paddle.Tensor, labels: paddle.Tensor, ignore_index: int = -100
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(fp32 sum of token losses over non-ignored labels, fp32 count), with one fused softmax-xent pass."""
    _need_float("logits", "cross_entropy_sum", logits)
    logits = logits.reshape([-1, logits.shape[-1]])
    labels = _check_labels("cross_entropy_sum", labels, logits.shape[0])
    if paddle.is_grad_enabled() and not logits.stop_gradient:
        count = (labels != ignore_index).astype("float32").sum()
        return _CrossEntropySum.apply(logits, labels, ignore_index), count
    lf = contiguous(logits.astype(_logits_dtype(logits)))
    loss = _ext().bmt_softmax_xent_loss(lf, labels, int(ignore_index))
    return loss.sum().astype("float32"), (labels != ignore_index).astype("float32").sum()


def _chunks(n: int, vocab: int, chunk_tokens: Optional[int], on_gpu: bool = False):
    """(lo, hi) token ranges of the fused LM-head loss (ops/loss_chunks.chunk_tokens)."""
    step = chunk_tokens or lm_chunk_tokens(vocab, n, on_gpu)
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)


class _LinearCrossEntropy(PyLayer):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, transpose_weight, chunk_tokens):
        ext = _ext()
        need_h, need_w = not hidden.stop_gradient, not weight.stop_gradient
        n = hidden.shape[0]
        vocab = weight.shape[0] if transpose_weight else weight.shape[1]
        acc = _logits_dtype(hidden)
        # the weight gradient accumulates in fp32 for fp32/fp64 weights, in the weight's own dtype for
        # fp16/bf16 (where it lands anyway): no fp32 [vocab, hidden] buffer per forward on a GPU
        w_acc = acc if weight.dtype in (paddle.float32, paddle.float64) else weight.dtype
        total = paddle.zeros([], dtype=acc)
        dh = paddle.empty_like(hidden) if need_h else None
        dw = None  # the first chunk's weight gradient, then the later chunks added in place
        for lo, hi in _chunks(n, vocab, chunk_tokens, not hidden.place.is_cpu_place()):
            h = hidden[lo:hi]
            logits = paddle.matmul(h, weight, transpose_y=transpose_weight).astype(acc)
            loss, dlogits = ext.bmt_softmax_xent(logits, labels[lo:hi], int(ignore_index))
            del logits
            total = total + loss.sum()
            dl = dlogits.astype(hidden.dtype)
            if need_h:
                dh[lo:hi] = paddle.matmul(dl, weight, transpose_y=not transpose_weight)
            if need_w:
                part = (
                    paddle.matmul(dl, h, transpose_x=True) if transpose_weight else paddle.matmul(h, dl, True)
                )
                dw = part.astype(w_acc) if dw is None else dw.add_(part.astype(w_acc))  # astype: no copy
                del part
        if need_w and dw is None:  # no tokens at all
            dw = paddle.zeros(weight.shape, dtype=w_acc)
        count = (labels != ignore_index).astype("float32").sum()
        ctx.mark_non_differentiable(count)
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = weight.dtype
        return total.astype("float32"), count

    @staticmethod
    def backward(ctx, grad_loss, grad_count):
        dh, dw = ctx.saved_tensor()
        # scaled in place: the saved gradients are used once, and a new [vocab, hidden] tensor costs a page
        # fault per page on a CPU (x * g: 100 ms against scale_: 5 ms for 49152 x 576 fp32)
        gh = None if dh is None else dh.scale_(grad_loss.astype(dh.dtype))
        gw = None if dw is None else dw.scale_(grad_loss.astype(dw.dtype)).astype(ctx.w_dtype)
        return gh, gw, None


def linear_cross_entropy(
    hidden: paddle.Tensor,
    weight: paddle.Tensor,
    labels: paddle.Tensor,
    ignore_index: int = -100,
    transpose_weight: bool = False,
    chunk_tokens: Optional[int] = None,
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """LM-head loss (fp32 sum, fp32 count) in chunks of tokens, never materialising [tokens, vocab].

    hidden: [tokens, hidden]; weight: [hidden, vocab], or [vocab, hidden] with transpose_weight (tied
    embeddings); labels: [tokens] with ignore_index on tokens that do not count.
    """
    op = "linear_cross_entropy"
    _need_float("hidden", op, hidden)
    if hidden.ndim != 2 or weight.ndim != 2:
        raise ValueError(
            f"{op}: hidden must be [tokens, hidden] and weight 2-D, got {hidden.shape}, {weight.shape}"
        )
    h_dim = weight.shape[1] if transpose_weight else weight.shape[0]
    if _dims_differ([h_dim], [hidden.shape[1]]):
        layout = "[vocab, hidden]" if transpose_weight else "[hidden, vocab]"
        raise ValueError(f"{op}: weight {weight.shape} ({layout}) does not match hidden {hidden.shape}")
    labels = _check_labels(op, labels, hidden.shape[0])
    if weight.dtype != hidden.dtype:
        weight = weight.astype(hidden.dtype)
    hidden, weight = contiguous(hidden), contiguous(weight)
    if _traced():
        # The chunk loop writes the gradients in place inside a PyLayer, which a static program cannot
        # express (to_static turns add_/setitem into copies): whole logits + the fused softmax-xent instead.
        logits = paddle.matmul(hidden, weight, transpose_y=transpose_weight)
        return cross_entropy_sum(logits, labels, ignore_index)
    if paddle.is_grad_enabled() and not (hidden.stop_gradient and weight.stop_gradient):
        return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, transpose_weight, chunk_tokens)
    ext = _ext()
    vocab = weight.shape[0] if transpose_weight else weight.shape[1]
    acc = _logits_dtype(hidden)
    total = paddle.zeros([], dtype=acc)
    for lo, hi in _chunks(hidden.shape[0], vocab, chunk_tokens, not hidden.place.is_cpu_place()):
        logits = paddle.matmul(hidden[lo:hi], weight, transpose_y=transpose_weight).astype(acc)
        total = total + ext.bmt_softmax_xent_loss(logits, labels[lo:hi], int(ignore_index)).sum()
    return total.astype("float32"), (labels != ignore_index).astype("float32").sum()
