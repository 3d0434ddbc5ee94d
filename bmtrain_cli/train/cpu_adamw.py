"""AdamW for the CPU build whose update avoids Paddle's CPU ``adamw`` kernel.

Measured (docs/benchmarks.md, "The slowdown after the first optimizer step"): with OMP_NUM_THREADS=2,
after the first ``paddle.optimizer.Adam``/``AdamW`` step every later matmul of the process takes ~3-4x
the CPU time it took before (a 384x576 @ 576x1536 matmul: 20 ms -> 70-98 ms), also on tensors the optimizer
never touched. SGD and Momentum steps, and the same AdamW arithmetic written with Paddle's elementwise
ops, leave it at 20 ms; with one thread there is no slowdown. Paddle's CPU adam/adamw kernels run
xbyak-generated AVX code (phi/kernels/funcs/jit/gen/adamw.h) split over threads; its ``postCode`` returns
without ``vzeroupper``, which leaves the upper YMM state dirty in the threads that ran it. This class keeps
Paddle's AdamW (its accumulators, state_dict names, learning-rate schedule, decay rule, grad clip, param
groups) and replaces only the per-parameter update with the same formula in elementwise ops.
"""

from __future__ import annotations

import math
from typing import Any

import paddle


class CpuAdamW(paddle.optimizer.AdamW):
    """paddle.optimizer.AdamW with the update written in Paddle's elementwise ops (same results, same
    state; fp16/bf16 master-weight updates and AMSGrad keep Paddle's kernel)."""

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
        with paddle.no_grad():
            decay = self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name)
            if decay and self._weight_decay:
                param.scale_(1.0 - lr * self._weight_decay)
            moment1.scale_(beta1).add_(grad * (1.0 - beta1))
            moment2.scale_(beta2).add_(grad * grad * (1.0 - beta2))
            step = lr * math.sqrt(1.0 - b2p) / (1.0 - b1p)
            denom = paddle.sqrt(moment2).add_(
                paddle.full([], self._epsilon * math.sqrt(1.0 - b2p), param.dtype)
            )
            param.add_(moment1 / denom * (-step))
            beta1_pow.scale_(beta1)
            beta2_pow.scale_(beta2)
        return None


def _scalar(t: Any) -> float:
    return float(t.reshape([-1])[0]) if isinstance(t, paddle.Tensor) else float(t)
