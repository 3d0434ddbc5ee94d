"""AdamW with parameter groups, fp32 global-norm clipping, and mixed precision (AMP O1/O2, loss scaling).

* No weight decay on norm weights and biases (any 1-D parameter or a name containing "norm"/"bias").
* The global gradient norm is always computed in fp32, whatever the gradient dtype; it is also the
  non-finite check of a step.
* bf16/fp16 run through ``paddle.amp`` on a GPU build: O2 keeps fp32 master weights in the optimizer
  (``multi_precision``), fp16 adds a dynamic loss scale (``paddle.amp.GradScaler``). On a CPU build
  Paddle's AMP silently does nothing, so :func:`check_precision_supported` refuses it up front.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Dict, Iterator, List, Literal, Optional, Sequence, Set, Tuple, TypeVar

import numpy as np
import paddle

from bmtrain_cli.errors import UserError

LayerT = TypeVar("LayerT", bound=paddle.nn.Layer)  # what decorate() hands back: the model it was given

AMP_DTYPES: Dict[str, Literal["bfloat16", "float16"]] = {"bf16": "bfloat16", "fp16": "float16"}


def decays(name: str, param: paddle.Tensor) -> bool:
    """Whether weight decay applies to a parameter (not to norms, biases or other 1-D tensors)."""
    lowered = name.lower()
    if len(param.shape) <= 1:
        return False
    return not ("norm" in lowered or lowered.endswith("bias") or lowered.endswith(".b_0"))


def trainable_parameters(model: paddle.nn.Layer) -> List[Tuple[str, paddle.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]


def decay_names(model: paddle.nn.Layer) -> Set[str]:
    """Paddle-internal names (``param.name``) of the parameters that get weight decay."""
    return {p.name for n, p in trainable_parameters(model) if decays(n, p)}


def build_optimizer(
    model: paddle.nn.Layer,
    train_cfg: Any,
    learning_rate: float,
    *,
    multi_precision: bool = False,
    grad_clip: Optional[float] = None,
    offload: bool = False,
) -> Any:
    """AdamW over the trainable parameters. ``grad_clip`` attaches Paddle's global-norm clip to the
    optimizer (used under tensor/pipeline parallel, where fleet turns it into a cross-rank clip);
    otherwise the trainer clips with :func:`clip_for_step` before ``step()``. ``offload`` keeps the
    optimizer state in host memory (train/optimizer/offload.py). On the CPU (and for offloaded states) the update is
    train/optimizer/cpu_adamw.CpuAdamW: Paddle's CPU adamw kernel slows every later matmul 3-4x with 2+ threads."""
    params = [p for _, p in trainable_parameters(model)]
    if not params:
        raise UserError("the model has no trainable parameters")
    with_decay = decay_names(model)
    kwargs = dict(
        learning_rate=learning_rate,
        beta1=train_cfg.adam_beta1,
        beta2=train_cfg.adam_beta2,
        epsilon=train_cfg.adam_epsilon,
        weight_decay=train_cfg.weight_decay,
        apply_decay_param_fun=lambda name: name in with_decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(grad_clip) if grad_clip else None,
        multi_precision=multi_precision,
    )
    from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW

    if offload:  # the update runs on the host copies: the CPU AdamW
        from bmtrain_cli.train.optimizer.offload import OffloadOptimizer

        return OffloadOptimizer(params, CpuAdamW, **kwargs)
    on_cpu = paddle.get_device() == "cpu"
    return (CpuAdamW if on_cpu else paddle.optimizer.AdamW)(parameters=params, **kwargs)


def grads_of(params: Sequence[paddle.Tensor]) -> List[paddle.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def grad_norm_tensor(params: Sequence[paddle.Tensor]) -> Optional[paddle.Tensor]:
    """sqrt(sum of squared gradients) as a 0-d fp32 tensor on the device (no host sync); None when no
    parameter has a gradient. inf/nan when any gradient is non-finite. CPU float32/float64 gradients go
    through one pass of our C++ kernel (ops/grad_norm.py: no squared copies, one OpenMP region; accumulated
    in double), the others (GPU, half precision, no compiler) through Paddle's square + sum in fp32."""
    grads = grads_of(params)
    if not grads:
        return None
    from bmtrain_cli.ops.grad_norm import kernel_available, sum_squares

    with paddle.no_grad():
        squares = []
        if kernel_available():
            total, grads = sum_squares(grads)
            if total is not None:
                squares.append(total)
        squares += [
            paddle.sum(paddle.square(g if g.dtype == paddle.float32 else g.astype("float32"))) for g in grads
        ]
        total = paddle.add_n(squares) if len(squares) > 1 else squares[0]
        return paddle.sqrt(total)


def global_grad_norm(params: Sequence[paddle.Tensor]) -> float:
    """sqrt(sum of squared gradients), accumulated in fp32. inf/nan when any gradient is non-finite."""
    norm = grad_norm_tensor(params)
    return 0.0 if norm is None else float(norm)


def clip_factor(max_norm: float, total_norm: float) -> float:
    """The factor that brings the global gradient norm to at most ``max_norm`` (1.0 when it already is, when
    clipping is off or when the norm is not finite)."""
    if not max_norm or max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)


def clip_grads_(params: Sequence[paddle.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale gradients in place so their global norm is at most ``max_norm``; returns the factor."""
    factor = clip_factor(max_norm, total_norm)
    if factor != 1.0:
        with paddle.no_grad():
            for g in grads_of(params):
                g.scale_(factor)
    return factor


def clip_for_step(
    optimizer: Any, params: Sequence[paddle.Tensor], max_norm: float, total_norm: float
) -> float:
    """Clip the gradients that ``optimizer.step()`` is about to use; returns the factor. A CpuAdamW takes the
    factor for its next step (train/optimizer/cpu_adamw.py: the fused kernel folds it into its read of the gradient,
    which saves a pass over every gradient); any other optimizer (Paddle's AdamW on a GPU, the offload
    wrapper, fleet's wrappers) gets its gradients scaled in place by :func:`clip_grads_`. The gradients
    must not be read again before that step."""
    from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW

    if type(optimizer) is CpuAdamW:  # exactly ours: a wrapper that forwards attributes does not step it
        factor = clip_factor(max_norm, total_norm)
        if factor != 1.0:
            optimizer.set_grad_scale(factor)
        return factor
    return clip_grads_(params, max_norm, total_norm)


def check_precision_supported(precision: str, has_gpu: bool) -> None:
    """Refuse bf16/fp16 where Paddle cannot run them (the CPU build)."""
    if precision == "fp32":
        return
    if not has_gpu:
        raise UserError(
            f"precision {precision} needs a GPU build of Paddle with a visible GPU: on the CPU build "
            "paddle.amp does nothing and bf16/fp16 matmuls have no kernel (use precision: fp32 here)"
        )
    if precision == "bf16" and not _bf16_supported():
        raise UserError(
            "precision bf16 needs a GPU with bf16 support (compute capability 8.0+); use fp16 or fp32"
        )


def _bf16_supported() -> bool:
    try:
        major, _ = paddle.device.cuda.get_device_capability()
        return major >= 8
    except (RuntimeError, ValueError, AttributeError):
        return False


def is_offload_optimizer(optimizer: Any) -> bool:
    from bmtrain_cli.train.optimizer.offload import OffloadOptimizer

    return isinstance(optimizer, OffloadOptimizer)


class Precision:
    """Everything precision-specific in one place: autocast, loss scaling, the optimizer step."""

    def __init__(
        self, precision: str = "fp32", amp_level: Literal["O1", "O2"] = "O2", loss_scale: float = 32768.0
    ):
        self.precision = precision
        self.amp_level = amp_level
        self.enabled = precision in AMP_DTYPES
        self.dtype: Literal["bfloat16", "float16", "float32"] = AMP_DTYPES.get(precision, "float32")
        self.scaler: Optional[paddle.amp.GradScaler] = None
        if precision == "fp16":
            self.scaler = paddle.amp.GradScaler(init_loss_scaling=loss_scale, use_dynamic_loss_scaling=True)

    @property
    def master_weights(self) -> bool:
        return self.enabled and self.amp_level == "O2"

    def decorate(self, model: LayerT, optimizer: Any) -> Tuple[LayerT, Any]:
        """Cast the model for O2 (fp32 master weights stay in the optimizer).

        The optimizer-offload wrapper (train/optimizer/offload.py) is not a Paddle optimizer that paddle.amp.decorate
        accepts, and it keeps fp32 master copies on the host itself: only the model is decorated then.
        Paddle casts the model's parameters in place and hands back the same object."""
        if not self.master_weights:
            return model, optimizer
        if is_offload_optimizer(optimizer):
            paddle.amp.decorate(models=model, level="O2", dtype=self.dtype, master_weight=False)
            return model, optimizer
        _, optimizer = paddle.amp.decorate(
            models=model, optimizers=optimizer, level="O2", dtype=self.dtype, master_weight=True
        )
        return model, optimizer

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with paddle.amp.auto_cast(enable=True, level=self.amp_level, dtype=self.dtype):
            yield

    def backward(self, loss: paddle.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def unscale(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any, finite: bool) -> bool:
        """Apply the update unless the gradients are non-finite; returns whether it was applied.
        With fp16 the scaler skips the step on inf/nan itself and lowers the loss scale."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
            return finite
        if finite:
            optimizer.step()
        return finite

    def overflowed(self) -> bool:
        """Whether the fp16 scaler found inf/nan gradients in the step just taken (it skipped the update
        and lowered the scale); False without a scaler."""
        return self.scaler is not None and found_inf(getattr(self.scaler, "_cache_found_inf", None))

    @property
    def loss_scale(self) -> Optional[float]:
        if self.scaler is None:
            return None
        scale = getattr(self.scaler, "_scale", None)
        return float(scale) if scale is not None else None

    def state_dict(self) -> Dict[str, Any]:
        if self.scaler is None:
            return {}
        return {k: _plain(v) for k, v in self.scaler.state_dict().items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.scaler is not None and state:
            restored = {
                k: np.asarray(v, dtype="float32") if isinstance(v, list) else v for k, v in state.items()
            }
            self.scaler.load_state_dict(restored)  # type: ignore[arg-type]  # what state_dict() saved


def found_inf(flag: Any) -> bool:
    """GradScaler's ``_cache_found_inf`` after step(): a bool, a bool/int tensor (when the optimizer took
    found_inf as an auxiliary variable) or None (no step yet)."""
    if flag is None:
        return False
    if isinstance(flag, paddle.Tensor):
        return bool(flag.astype("int32").reshape([-1])[0].item())
    return bool(flag)


def _plain(value: Any) -> Any:
    """JSON-friendly form of a scaler state value."""
    if isinstance(value, paddle.Tensor):
        value = value.numpy()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value
