"""The multi-tensor fused CPU AdamW update (kernels/cpu/adamw_cpu.cc) behind a checked wrapper.

Layers: the launcher ``bmt_cpu_adamw_multi`` (C ABI: one OpenMP region over chunks of every tensor of the
list, the gradient read times a scale factor, each tensor's bias corrections from its own beta powers, which
it advances) <- the Paddle operator ``bmt_adamw_multi_`` (kernels/paddle/adamw_op.cc: list lengths, place,
dtype, size and contiguity checks, in place) <- :func:`adamw_multi_` here (Python-side checks with a clear
ValueError). train/optimizer/cpu_adamw.CpuAdamW calls it once per group of parameters that share learning rate,
weight decay and dtype, and falls back to the same formula in Paddle's elementwise ops when
:func:`unavailable_reason` says the kernel cannot be built.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import paddle

from bmtrain_cli.ops.build import KernelBuildError, load_extension
from bmtrain_cli.ops.custom import contiguous

_FLOATS = (paddle.float32, paddle.float64)


def unavailable_reason() -> Optional[str]:
    """None when the fused AdamW kernel is built and loaded, else why not (first line of the reason)."""
    try:
        load_extension()
    except KernelBuildError as exc:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


def adamw_multi_(
    params: Sequence[paddle.Tensor],
    grads: Sequence[paddle.Tensor],
    moment1: Sequence[paddle.Tensor],
    moment2: Sequence[paddle.Tensor],
    beta1_pow: Sequence[paddle.Tensor],
    beta2_pow: Sequence[paddle.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    weight_decay: float,
    grad_scale: float = 1.0,
) -> None:
    """One AdamW step of every parameter in place (Paddle's AdamW formula, decoupled decay), in one call:

    g = grad_scale * grad; p *= 1 - lr wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps sqrt(1-b2^t)), with b^t the parameter's
    ``beta*_pow`` (one-element tensors of its dtype), which then become b^(t+1). The gradients are read,
    not written. ``grad_scale`` folds a global-norm clip factor into the update.
    """
    n = len(params)
    if n == 0:
        raise ValueError("fused adamw: no parameters")
    for name, seq in (("grads", grads), ("moment1", moment1), ("moment2", moment2)):
        if len(seq) != n:
            raise ValueError(f"fused adamw: {len(seq)} {name} for {n} parameters")
    for name, seq in (("beta1_pow", beta1_pow), ("beta2_pow", beta2_pow)):
        if len(seq) != n:
            raise ValueError(f"fused adamw: {len(seq)} {name} for {n} parameters")
    dtype = params[0].dtype
    if dtype not in _FLOATS:
        raise ValueError(f"fused adamw: the parameters are {dtype}; the CPU kernel takes float32/float64")
    for i, p in enumerate(params):
        shape = p.shape
        for name, t in (("param", p), ("grad", grads[i]), ("moment1", moment1[i]), ("moment2", moment2[i])):
            if t.dtype != dtype or t.shape != shape:
                raise ValueError(
                    f"fused adamw: {name} {i} is {t.dtype} {list(t.shape)}, parameter {i} {dtype} {list(shape)}"
                )
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"fused adamw: betas must lie in [0, 1), got beta1={beta1}, beta2={beta2}")
    if not (math.isfinite(lr) and math.isfinite(grad_scale) and grad_scale >= 0.0):
        raise ValueError(
            f"fused adamw: lr must be finite and grad_scale finite and >= 0, got {lr}, {grad_scale}"
        )
    load_extension().bmt_adamw_multi_(
        # detach: the same memory; Paddle refuses in-place custom ops on a leaf that needs a gradient
        [p.detach() for p in params],
        [contiguous(g) for g in grads],
        list(moment1),
        list(moment2),
        list(beta1_pow),
        list(beta2_pow),
        lr,
        weight_decay,
        beta1,
        beta2,
        epsilon,
        grad_scale,
    )
