"""The fused CPU AdamW update (kernels/cpu/adamw_cpu.cc) behind a checked wrapper.

Layers: the launcher ``bmt_cpu_adamw`` (C ABI, one OpenMP pass over param/grad/moment1/moment2) <- the
Paddle operator ``bmt_adamw_`` (kernels/paddle/adamw_op.cc: place, dtype, size and contiguity checks, in
place) <- :func:`adamw_` here (Python-side checks with a clear ValueError, the step's scalars from the
learning rate and the bias corrections). train/cpu_adamw.CpuAdamW calls it, and falls back to the same
formula in Paddle's elementwise ops when :func:`unavailable_reason` says the kernel cannot be built.
"""

from __future__ import annotations

import math
from typing import Optional

import paddle

from bmtrain_cli.ops.build import KernelBuildError, load_extension

_FLOATS = (paddle.float32, paddle.float64)


def unavailable_reason() -> Optional[str]:
    """None when the fused AdamW kernel is built and loaded, else why not (first line of the reason)."""
    try:
        load_extension()
    except KernelBuildError as exc:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


def adamw_(
    param: paddle.Tensor,
    grad: paddle.Tensor,
    moment1: paddle.Tensor,
    moment2: paddle.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    weight_decay: float,
    beta1_pow: float,
    beta2_pow: float,
) -> None:
    """One AdamW step of ``param`` in place (Paddle's AdamW formula, decoupled decay):

    p *= 1 - lr wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr sqrt(1-b2^t) / (1-b1^t) * m / (sqrt(v) + eps sqrt(1-b2^t)), with b^t = ``beta*_pow``.
    """
    if param.dtype not in _FLOATS:
        raise ValueError(f"fused adamw: the parameter is {param.dtype}; the CPU kernel takes float32/float64")
    for name, t in (("grad", grad), ("moment1", moment1), ("moment2", moment2)):
        if t.dtype != param.dtype or t.shape != param.shape:
            raise ValueError(
                f"fused adamw: {name} is {t.dtype} {list(t.shape)}, the parameter {param.dtype} {list(param.shape)}"
            )
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and 0.0 <= beta1_pow < 1.0 and 0.0 <= beta2_pow < 1.0):
        raise ValueError(
            f"fused adamw: betas and their powers must lie in [0, 1), got beta1={beta1}, "
            f"beta2={beta2}, beta1_pow={beta1_pow}, beta2_pow={beta2_pow}"
        )
    if not grad.is_contiguous():
        grad = grad.contiguous()
    correction2 = math.sqrt(1.0 - beta2_pow)
    load_extension().bmt_adamw_(
        param.detach(),  # same memory; Paddle refuses in-place custom ops on a leaf that needs a gradient
        grad,
        moment1,
        moment2,
        1.0 - lr * weight_decay,
        beta1,
        beta2,
        lr * correction2 / (1.0 - beta1_pow),
        epsilon * correction2,
    )
