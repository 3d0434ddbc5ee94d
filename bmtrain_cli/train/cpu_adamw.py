"""AdamW for the CPU build whose update avoids Paddle's CPU ``adamw`` kernel.

Measured (docs/benchmarks.md, "The slowdown after the first optimizer step"): with OMP_NUM_THREADS=2,
after the first ``paddle.optimizer.Adam``/``AdamW`` step every later matmul of the process takes ~3-4x
the CPU time it took before (a 384x576 @ 576x1536 matmul: 20 ms -> 70-98 ms), also on tensors the optimizer
never touched. SGD and Momentum steps, and the same AdamW arithmetic written with Paddle's elementwise
ops, leave it at 20 ms; with one thread there is no slowdown. Paddle's CPU adam/adamw kernels run
xbyak-generated AVX code (phi/kernels/funcs/jit/gen/adamw.h) split over threads; its ``postCode`` returns
without ``vzeroupper``, which leaves the upper YMM state dirty in the threads that ran it, and that state
penalises the SSE code MKL runs on AMD CPUs by default (with MKL's AVX2 code, bmtrain_cli/cpu_env.py, the
slowdown is gone too; this class does not depend on that). This class keeps
Paddle's AdamW (its accumulators, state_dict names, learning-rate schedule, decay rule, grad clip, param
groups) and replaces only the per-parameter update: by our fused C++ kernel (ops/fused_adamw.py, one pass
over param/grad/moments), or, when that cannot be built, by the same formula in Paddle's elementwise ops.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Optional

import paddle

from bmtrain_cli.ops import KernelFallbackWarning

_warned = False


class CpuAdamW(paddle.optimizer.AdamW):
    """paddle.optimizer.AdamW with the update done by our fused CPU kernel, or in Paddle's elementwise
    ops (same results, same state; fp16/bf16 master-weight updates and AMSGrad keep Paddle's kernel).

    ``fused``: None (default) uses the kernel when it builds and warns once when it falls back to the
    elementwise ops; True requires the kernel (a KernelBuildError when it cannot be built); False always
    uses the elementwise ops."""

    def __init__(self, *args: Any, fused: Optional[bool] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fused = _resolve_fused(fused)

    @property
    def fused(self) -> bool:
        """Whether the update runs in the fused C++ kernel."""
        return self._fused

    def _append_optimize_op(self, block: Any, param_and_grad: Any) -> Any:
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        if self._amsgrad or (self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)):
            return super()._append_optimize_op(block, param_and_grad)
        moment1 = self._get_accumulator_master(self._moment1_acc_str, param)
        moment2 = self._get_accumulator_master(self._moment2_acc_str, param)
        beta1_pow = self._get_accumulator_master(self._beta1_pow_acc_str, param)
        beta2_pow = self._get_accumulator_master(self._beta2_pow_acc_str, param)
        lr = _scalar(self._create_param_lr(param_and_grad))
        lr *= 1.0 if self._lr_ratio is None else self._lr_ratio(param)
        beta1, beta2 = float(self._beta1), float(self._beta2)
        b1p, b2p = _scalar(beta1_pow), _scalar(beta2_pow)  # beta^t of this step (they start at beta)
        decay = self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name)
        wd = float(self._weight_decay or 0.0) if decay else 0.0
        with paddle.no_grad():
            if self._fused and param.place.is_cpu_place() and param.dtype in (paddle.float32, paddle.float64):
                from bmtrain_cli.ops.fused_adamw import adamw_

                adamw_(
                    param, grad, moment1, moment2, lr=lr, beta1=beta1, beta2=beta2,
                    epsilon=float(self._epsilon), weight_decay=wd, beta1_pow=b1p, beta2_pow=b2p,
                )  # fmt: skip
            else:
                _update_elementwise(
                    param, grad, moment1, moment2, lr, beta1, beta2, self._epsilon, wd, b1p, b2p
                )
            beta1_pow.scale_(beta1)
            beta2_pow.scale_(beta2)
        return None


def _update_elementwise(
    param: paddle.Tensor,
    grad: paddle.Tensor,
    moment1: paddle.Tensor,
    moment2: paddle.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: float,
    wd: float,
    b1p: float,
    b2p: float,
) -> None:
    """The AdamW update in Paddle's elementwise ops (the fallback of the fused kernel)."""
    if wd:
        param.scale_(1.0 - lr * wd)
    moment1.scale_(beta1).add_(grad * (1.0 - beta1))
    moment2.scale_(beta2).add_(grad * grad * (1.0 - beta2))
    step = lr * math.sqrt(1.0 - b2p) / (1.0 - b1p)
    denom = paddle.sqrt(moment2).add_(paddle.full([], epsilon * math.sqrt(1.0 - b2p), param.dtype))
    param.add_(moment1 / denom * (-step))


def _resolve_fused(fused: Optional[bool]) -> bool:
    global _warned
    if fused is False:
        return False
    from bmtrain_cli.ops.fused_adamw import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return True
    if fused:
        from bmtrain_cli.ops.build import KernelBuildError

        raise KernelBuildError(f"the fused CPU AdamW kernel is unavailable: {reason}")
    if not _warned:
        _warned = True
        warnings.warn(
            f"fused CPU AdamW unavailable ({reason}); using Paddle's elementwise ops for the update",
            KernelFallbackWarning,
            stacklevel=3,
        )
    return False


def _scalar(t: Any) -> float:
    return float(t.reshape([-1])[0]) if isinstance(t, paddle.Tensor) else float(t)
