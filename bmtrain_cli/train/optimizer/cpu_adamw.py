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
groups) and replaces only the update: by our multi-tensor fused C++ kernel (ops/fused_adamw.py, one pass
over param/grad/moments of a whole group of parameters, the clip factor folded into the gradient read),
or, when that cannot be built, by the same formula in Paddle's elementwise ops per parameter.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import paddle

from bmtrain_cli.ops import warn_fallback

_warned = False


class CpuAdamW(paddle.optimizer.AdamW):
    """paddle.optimizer.AdamW with the update done by our multi-tensor fused CPU kernel, or in Paddle's
    elementwise ops (same results, same state; fp16/bf16 master-weight updates and AMSGrad keep Paddle's
    kernel).

    ``fused``: None (default) uses the kernel when it builds and warns once when it falls back to the
    elementwise ops; True requires the kernel (a KernelBuildError when it cannot be built); False always
    uses the elementwise ops.

    With the kernel, ``step()`` collects the fp32/fp64 CPU parameters as Paddle visits them and, at the end
    of each pass (``_finish_update``), updates each group of parameters that share learning rate, weight
    decay and dtype in one call: one OpenMP region over all of the group's tensors, the learning rate read
    once per pass, each parameter's beta powers read and advanced inside the kernel (no host reads).
    :meth:`set_grad_scale` hands the trainer's clip factor to the next step, where the kernel folds it
    into its read of the gradient (the other paths scale the gradient first)."""

    def __init__(self, *args: Any, fused: Optional[bool] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fused = _resolve_fused(fused)
        self._grad_scale = 1.0
        self._pending: Dict[Tuple[float, float, Any], List[_Entry]] = {}
        self._pass_lr: Dict[float, float] = {}  # per-parameter lr multiplier -> lr of this pass

    @property
    def fused(self) -> bool:
        """Whether the update runs in the fused C++ kernel."""
        return self._fused

    def set_grad_scale(self, factor: float) -> None:
        """The current gradients count as multiplied by ``factor`` (the global-norm clip factor) in the next
        ``step()``; the step or ``clear_grad()`` resets it to 1."""
        if not (math.isfinite(factor) and factor >= 0.0):
            raise ValueError(f"CpuAdamW.set_grad_scale: the factor must be finite and >= 0, got {factor}")
        self._grad_scale = float(factor)

    @paddle.no_grad()
    def step(self) -> None:
        try:
            super().step()
        finally:
            self._grad_scale = 1.0
            self._pending, self._pass_lr = {}, {}

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self._grad_scale = 1.0
        super().clear_grad(set_to_zero)  # Paddle's __init__ binds clear_gradients to this too

    def _append_optimize_op(self, block: Any, param_and_grad: Any) -> Any:
        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        if self._amsgrad or (self._multi_precision and self._is_dtype_fp16_or_bf16(param.dtype)):
            self._scale_grad(grad)
            return super()._append_optimize_op(block, param_and_grad)
        moment1 = self._get_accumulator_master(self._moment1_acc_str, param)
        moment2 = self._get_accumulator_master(self._moment2_acc_str, param)
        beta1_pow = self._get_accumulator_master(self._beta1_pow_acc_str, param)
        beta2_pow = self._get_accumulator_master(self._beta2_pow_acc_str, param)
        lr = self._param_lr(param_and_grad)
        decay = self._apply_decay_param_fun is None or self._apply_decay_param_fun(param.name)
        wd = float(self._weight_decay or 0.0) if decay else 0.0
        if self._fused and param.place.is_cpu_place() and param.dtype in (paddle.float32, paddle.float64):
            entry = _Entry(param, grad, moment1, moment2, beta1_pow, beta2_pow)
            self._pending.setdefault((lr, wd, param.dtype), []).append(entry)
            return None
        beta1, beta2 = float(self._beta1), float(self._beta2)
        b1p, b2p = _scalar(beta1_pow), _scalar(beta2_pow)  # beta^t of this step (they start at beta)
        with paddle.no_grad():
            self._scale_grad(grad)
            _update_elementwise(param, grad, moment1, moment2, lr, beta1, beta2, self._epsilon, wd, b1p, b2p)
            beta1_pow.scale_(beta1)
            beta2_pow.scale_(beta2)
        return None

    def _finish_update(self, block: Any, parameters_and_grads: Any) -> None:
        """Run the fused update of the parameters collected in this pass, one kernel call per group."""
        pending, self._pending, self._pass_lr = self._pending, {}, {}
        if not pending:
            return
        from bmtrain_cli.ops.fused_adamw import adamw_multi_

        beta1, beta2 = float(self._beta1), float(self._beta2)
        with paddle.no_grad():
            for (lr, wd, _), entries in pending.items():
                adamw_multi_(
                    *(list(column) for column in zip(*entries)),
                    lr=lr, beta1=beta1, beta2=beta2, epsilon=float(self._epsilon), weight_decay=wd,
                    grad_scale=self._grad_scale,
                )  # fmt: skip

    def _param_lr(self, param_and_grad: Any) -> float:
        """This step's learning rate of a parameter (Paddle's rule: the global lr times the parameter's
        ``optimize_attr`` multiplier, times ``lr_ratio``), read from its tensor once per multiplier and pass."""
        param = param_and_grad[0]
        multiplier = (getattr(param, "optimize_attr", None) or {}).get("learning_rate", 1.0)
        if isinstance(multiplier, (int, float)):
            lr = self._pass_lr.get(float(multiplier))
            if lr is None:
                lr = self._pass_lr[float(multiplier)] = _scalar(self._create_param_lr(param_and_grad))
        else:  # a tensor-valued multiplier: read it each time
            lr = _scalar(self._create_param_lr(param_and_grad))
        return lr * (1.0 if self._lr_ratio is None else self._lr_ratio(param))

    def _scale_grad(self, grad: paddle.Tensor) -> None:
        """The folded clip for the paths outside the fused kernel: scale the gradient in place first."""
        if self._grad_scale != 1.0:
            with paddle.no_grad():
                grad.scale_(self._grad_scale)


class _Entry(NamedTuple):
    """One parameter of a fused update, in the order of adamw_multi_'s lists."""

    param: paddle.Tensor
    grad: paddle.Tensor
    moment1: paddle.Tensor
    moment2: paddle.Tensor
    beta1_pow: paddle.Tensor
    beta2_pow: paddle.Tensor


def _update_elementwise(
    param: paddle.Tensor,
    grad: paddle.Tensor,
    moment1: paddle.Tensor,
    moment2: paddle.Tensor,
    lr: float,
    beta1: float,
    beta2: float,
    epsilon: Union[float, paddle.Tensor],  # the optimizer's (Paddle accepts a tensor)
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
        warn_fallback(reason, "using Paddle's own ops instead (same results, slower)", stacklevel=4)
    return False


def _scalar(t: Any) -> float:
    return float(t.reshape([-1])[0]) if isinstance(t, paddle.Tensor) else float(t)
