"""Paddle's built-in fused ops behind the OpSet signatures, where the device has them.

On the Paddle 3.3 CPU wheel only swiglu (forward and backward) and softmax_with_cross_entropy have CPU
kernels; fused_rms_norm has no CPU backward and fused_rotary_position_embedding no CPU kernel at all, so
``available(device)`` leaves those out on CPU (ops/choice.PADDLE_FUSED_CPU) and the caller falls back to the reference. The GPU entries
follow Paddle's documented signatures; they cannot run on this CPU-only machine (see docs/kernels.md).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Tuple

import paddle
import paddle.nn.functional as F

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.ops.choice import PADDLE_FUSED_CPU, PADDLE_FUSED_GPU

# Paddle 3.x marks its one fused softmax + cross-entropy op deprecated (cross_entropy wraps it); the
# warning reached users of `kernels: auto`, whose CPU timing tries this op
warnings.filterwarnings("ignore", message="(?s).*softmax_with_cross_entropy")


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    from paddle.incubate.nn.functional import fused_rms_norm

    out = fused_rms_norm(x, weight.astype(x.dtype), None, eps, begin_norm_axis=x.ndim - 1)
    return out[0] if isinstance(out, (tuple, list)) else out


def rotary(
    q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    from paddle.incubate.nn.functional import fused_rotary_position_embedding

    b, s, _, d = q.shape
    if cos.shape[0] != 1:
        # Per-row positions (packed samples): fold batch into the sequence, where the op takes [1, s, 1, d].
        qf, kf = q.reshape([1, b * s, q.shape[2], d]), k.reshape([1, b * s, k.shape[2], d])
        c, sn = cos.reshape([1, b * s, 1, d]), sin.reshape([1, b * s, 1, d])
        qo, ko, _ = fused_rotary_position_embedding(qf, kf, None, sin=sn, cos=c, use_neox_rotary_style=False)
        return qo.reshape(q.shape), ko.reshape(k.shape)
    c, sn = cos.unsqueeze(2).astype(q.dtype), sin.unsqueeze(2).astype(q.dtype)
    qo, ko, _ = fused_rotary_position_embedding(q, k, None, sin=sn, cos=c, use_neox_rotary_style=False)
    return qo, ko


def swiglu(gate: paddle.Tensor, up: paddle.Tensor) -> paddle.Tensor:
    # paddle.nn.functional.swiglu where Paddle has it (3.3 deprecates the incubate one, with a warning that
    # reached users of `kernels: auto`, whose CPU timing tries this op)
    fn: Any = getattr(F, "swiglu", None)
    if fn is None:
        from paddle.incubate.nn.functional import swiglu as fn
    return fn(gate, up)


def cross_entropy_sum(
    logits: paddle.Tensor, labels: paddle.Tensor, ignore_index: int = IGNORE_INDEX
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """softmax_with_cross_entropy (one fused op, zero loss and gradient on ignored tokens), summed."""
    logits = logits.reshape([-1, logits.shape[-1]]).astype("float32")
    labels = labels.reshape([-1, 1]).astype("int64")
    loss = F.softmax_with_cross_entropy(logits, labels, ignore_index=ignore_index, return_softmax=False)
    return loss.sum(), (labels != ignore_index).astype("float32").sum()


def available(device: str) -> Dict[str, Callable]:
    """The built-in fused ops this device has (OpSet field name -> function)."""
    names = PADDLE_FUSED_GPU if device.startswith("gpu") else PADDLE_FUSED_CPU
    return {n: globals()[n] for n in names}
