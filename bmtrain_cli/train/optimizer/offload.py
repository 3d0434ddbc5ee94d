"""Optimizer offload for single-device training: the optimizer states (and, by default, the fp32 master
weights) live in host memory and are updated there, so the accelerator holds only the weights, the
gradients and the activations.

:class:`OffloadOptimizer` wraps a stock Paddle optimizer (AdamW by default) built over host copies of
the trainable parameters. Each ``step()`` copies the device gradients to the host, runs the stock
update on the host copies (so the arithmetic is Paddle's own optimizer kernel, not a re-implementation),
and writes the updated weights back to the device in the model's dtype. On a GPU the copies of a step go
through pinned buffers and are all issued before the step waits once (:class:`Transfers`), so the copy
engine overlaps them; the weights are cast to the model's dtype on the host before they travel. On a CPU-only machine the
"device" is the CPU itself and exactly the same code path runs (the copies are then host-to-host).

It has the interface the trainer uses from ``paddle.optimizer.Optimizer``: ``step()``,
``clear_grad()``, ``state_dict()``, ``set_state_dict()``, ``get_lr()``, ``set_lr()`` and
``_parameter_list`` (for ``paddle.amp.GradScaler.unscale_``). Its state-dict keys use the device
parameters' names, so a checkpoint written with offload resumes without it and the other way round.
With mixed precision O2, decorate only the model (``paddle.amp.decorate(models=model, ...)``): this
wrapper keeps the fp32 master weights itself.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional

import paddle

HOST_SUFFIX = "@host"
_STATE_META = ("LR_Scheduler", "master_weights")


@contextlib.contextmanager
def host_device() -> Iterator[None]:
    """Run the enclosed code with the CPU as Paddle's default device (new tensors land in host memory)."""
    previous = paddle.get_device()
    if previous == "cpu":
        yield
        return
    paddle.set_device("cpu")
    try:
        yield
    finally:
        paddle.set_device(previous)


def _to_place(tensor: paddle.Tensor, place: Any) -> paddle.Tensor:
    """A copy of ``tensor`` on ``place`` (always a copy, also when the place is the same)."""
    return tensor._copy_to(place, True)


def uses_pinned_staging(place: Any) -> bool:
    """Whether transfers between ``place`` and the host go through pinned (page-locked) buffers: only for
    a GPU place (the copy engine can then run them asynchronously, all of a step's tensors at once)."""
    return bool(getattr(place, "is_gpu_place", lambda: False)())


class Transfers:
    """A step's device <-> host copies. On a GPU every copy is issued without waiting, through pinned
    memory, and the step waits once (:meth:`wait`) instead of once per tensor through pageable memory;
    on a CPU they are the plain blocking copies. Pinned buffers are kept until :meth:`wait` returns."""

    def __init__(self, device_place: Any) -> None:
        self.device_place = device_place
        self.pinned = uses_pinned_staging(device_place)
        self._keep: List[paddle.Tensor] = []

    def to_host(self, tensor: paddle.Tensor, host_place: Any) -> Callable[[], paddle.Tensor]:
        """Start copying ``tensor`` to the host; the returned function gives the host tensor (after wait)."""
        if not self.pinned:
            out = _to_place(tensor, host_place)
            return lambda: out
        staged = tensor._copy_to(paddle.CUDAPinnedPlace(), False)  # device -> pinned, asynchronous
        self._keep.append(staged)
        return lambda: _to_place(staged, host_place)  # pinned -> pageable host: a memcpy, after wait()

    def to_device(self, host_tensor: paddle.Tensor, place: Any) -> paddle.Tensor:
        """Start copying a host tensor to ``place``; use the result after :meth:`wait` (or in stream order)."""
        if not self.pinned:
            return _to_place(host_tensor, place)
        staged = host_tensor._copy_to(paddle.CUDAPinnedPlace(), True)  # pageable -> pinned: a memcpy
        self._keep.append(staged)
        return staged._copy_to(place, False)  # pinned -> device, asynchronous

    def wait(self) -> None:
        if self.pinned:
            paddle.device.synchronize()
        self._keep.clear()


class OffloadOptimizer:
    """A Paddle optimizer whose state and update live in host memory.

    parameters: the model's parameters (frozen ones, ``stop_gradient=True``, are skipped).
    optimizer_cls: the optimizer to run on the host copies (train/optimizer/cpu_adamw.CpuAdamW from build_optimizer).
    master_on_host: keep the fp32 master weights on the host (True, the default) or on the device
        (False: the device keeps an fp32 master copy next to low-precision weights; each step stages
        it to the host for the update and back).
    optimizer_kwargs: passed to ``optimizer_cls`` (learning_rate, beta1, weight_decay, grad_clip, ...);
        ``apply_decay_param_fun`` receives the device parameters' names, as without offload.
    """

    def __init__(
        self,
        parameters: Iterable[paddle.Tensor],
        optimizer_cls: Callable[..., Any] = paddle.optimizer.AdamW,
        *,
        master_on_host: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        self._parameter_list: List[paddle.Tensor] = [p for p in parameters if not p.stop_gradient]
        if not self._parameter_list:
            raise ValueError("OffloadOptimizer: no trainable parameters")
        self._param_groups = None
        self.master_on_host = master_on_host
        self._host: List[paddle.Tensor] = []
        self._device_master: List[Optional[paddle.Tensor]] = []
        self._host_to_device_name: Dict[str, str] = {}
        with host_device():
            for p in self._parameter_list:
                host = paddle.create_parameter(
                    shape=p.shape,
                    dtype="float32",
                    name=p.name + HOST_SUFFIX,
                    default_initializer=paddle.nn.initializer.Constant(0.0),
                )
                self._host.append(host)
                self._host_to_device_name[host.name] = p.name
        for p in self._parameter_list:
            low_precision = p.dtype != paddle.float32
            self._device_master.append(
                p.astype("float32") if (low_precision and not master_on_host) else None
            )
        self.sync_from_model()
        decay_fn = optimizer_kwargs.pop("apply_decay_param_fun", None)
        if decay_fn is not None:
            names = self._host_to_device_name
            optimizer_kwargs["apply_decay_param_fun"] = lambda name: decay_fn(names.get(name, name))
        optimizer_kwargs.pop("multi_precision", None)  # the host copies are fp32 already
        with host_device():
            self._inner = optimizer_cls(parameters=self._host, **optimizer_kwargs)

    # ------------------------------------------------------------------ weights
    @paddle.no_grad()
    def sync_from_model(self) -> None:
        """Copy the model's current weights into the host masters (after loading weights by hand)."""
        for i, (p, host) in enumerate(zip(self._parameter_list, self._host)):
            master = self._device_master[i]
            if master is not None:
                master.set_value(_to_place(p.astype("float32"), master.place))
            host.set_value(_to_place(p.astype("float32"), host.place))

    @paddle.no_grad()
    def _write_back(self) -> None:
        moves = Transfers(self._parameter_list[0].place)
        for i, (p, host) in enumerate(zip(self._parameter_list, self._host)):
            master = self._device_master[i]
            if master is not None:
                master.set_value(moves.to_device(host, master.place))
            with host_device():  # cast on the host: half the bytes cross the bus for fp16/bf16 weights
                low = host.astype(p.dtype)
            p.set_value(moves.to_device(low, p.place))
        moves.wait()

    # ------------------------------------------------------------------ optimizer interface
    @paddle.no_grad()
    def step(self) -> None:
        moves = Transfers(self._parameter_list[0].place)
        grads: List[Any] = []
        masters: List[Any] = []
        for i, (p, host) in enumerate(zip(self._parameter_list, self._host)):
            grad = p.grad
            master = self._device_master[i]
            # every copy is started before any is waited for (on a GPU: asynchronous, through pinned memory)
            grads.append(None if grad is None else moves.to_host(grad.astype("float32"), host.place))
            masters.append(None if grad is None or master is None else moves.to_host(master, host.place))
        moves.wait()
        for host, grad, master in zip(self._host, grads, masters):
            if grad is None:
                host.clear_gradient(False)
                continue
            host.grad = grad()
            if master is not None:  # master kept on the device: staged for the host update
                host.set_value(master())
        with host_device():
            self._inner.step()
        self._write_back()
        for host in self._host:
            host.clear_gradient(False)  # free the host gradient copies until the next step

    def clear_grad(self, set_to_zero: bool = True) -> None:
        for p in self._parameter_list:
            p.clear_gradient(set_to_zero)

    clear_gradients = clear_grad

    def get_lr(self) -> float:
        return self._inner.get_lr()

    def set_lr(self, value: float) -> None:
        self._inner.set_lr(value)

    @property
    def _learning_rate(self) -> Any:
        return self._inner._learning_rate

    @property
    def inner(self) -> Any:
        """The host-side Paddle optimizer (its parameters are the host masters)."""
        return self._inner

    def host_bytes(self) -> int:
        """Host memory held by the masters and the optimizer states."""
        total = sum(int(h.numel()) * 4 for h in self._host)
        for accs in self._inner._accumulators.values():
            for t in accs.values():
                total += int(t.numel()) * t.element_size()
        return total

    # ------------------------------------------------------------------ checkpoints
    def _rename(self, key: str, mapping: Dict[str, str]) -> str:
        for src, dst in mapping.items():
            if key.startswith(src + "_"):
                return dst + key[len(src) :]
        return key

    def state_dict(self) -> Dict[str, Any]:
        """The host optimizer's state with the device parameters' names; the fp32 masters are included
        under ``master_weights`` when the model's weights are low precision (as Paddle does)."""
        inner = self._inner.state_dict()
        out: Dict[str, Any] = {}
        # longest names first so that "a.w" never matches a key of "a.w_1"
        mapping = dict(sorted(self._host_to_device_name.items(), key=lambda kv: -len(kv[0])))
        for key, value in inner.items():
            if key in _STATE_META:
                out[key] = value
            else:
                out[self._rename(key, mapping)] = value
        masters = {
            p.name: host for p, host in zip(self._parameter_list, self._host) if p.dtype != paddle.float32
        }
        if masters:
            out["master_weights"] = masters
        return out

    @paddle.no_grad()
    def set_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from a plain Paddle optimizer of the same model.
        The host masters are refreshed from the model's current weights (load the weights first) or
        from ``master_weights`` when present."""
        self.sync_from_model()
        device_to_host = {d: h for h, d in self._host_to_device_name.items()}
        mapping = dict(sorted(device_to_host.items(), key=lambda kv: -len(kv[0])))
        inner: Dict[str, Any] = {}
        for key, value in state_dict.items():
            if key == "master_weights":
                continue
            inner[key if key in _STATE_META else self._rename(key, mapping)] = value
        with host_device():
            self._inner.set_state_dict(inner)
        masters = state_dict.get("master_weights") or {}
        for i, (p, host) in enumerate(zip(self._parameter_list, self._host)):
            if p.name in masters:
                value = masters[p.name]
                value = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
                host.set_value(_to_place(value.astype("float32"), host.place))
                master = self._device_master[i]
                if master is not None:
                    master.set_value(_to_place(host, master.place))
