"""A one-shot launch check of our GPU kernels before ``kernels: auto`` chooses them.

A build for the wrong architectures succeeds and fails only at the first launch ("no kernel image is
available for execution on the device"), in the middle of the first training step. ``auto`` therefore runs
each kernel once, forward and backward, on a tiny input against the reference op, and keeps only those
that launch and agree; the others fall back, with one logged line for all of them.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

Check = Callable[[str, Callable, Callable], Optional[str]]


def launch_checked(ours: Dict[str, Callable], ref: Dict[str, Callable], check: Check) -> Tuple[Dict, Dict]:
    """(the ops that passed, {op: why it failed}); ``check(name, ours, ref)`` gives None or the reason."""
    kept: Dict[str, Callable] = {}
    failed: Dict[str, str] = {}
    for name, fn in ours.items():
        try:
            why = check(name, fn, ref[name])
        except Exception as exc:  # any launch failure means: do not use this kernel
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        if why is None:
            kept[name] = fn
        else:
            failed[name] = why
    return kept, failed


def fallback_line(failed: Dict[str, str]) -> str:
    """The one line logged when some kernels failed their launch check."""
    parts = "; ".join(f"{name}: {why}" for name, why in sorted(failed.items()))
    return f"our CUDA kernels failed their launch check on this GPU ({parts}); using Paddle's fused or the reference ops for them"


def _inputs(name: str) -> Tuple:
    import paddle

    paddle.seed(0)
    r = lambda *shape: paddle.randn(list(shape), dtype="float32")  # noqa: E731
    if name == "rms_norm":
        return r(4, 64), r(64), 1e-6
    if name == "rotary":
        return r(1, 4, 2, 16), r(1, 4, 2, 16), r(1, 4, 16), r(1, 4, 16)
    if name == "swiglu":
        return r(4, 64), r(4, 64)
    labels = paddle.to_tensor([1, 5, -100, 7], dtype="int64")
    if name == "linear_cross_entropy":
        return r(4, 32), r(32, 11), labels
    return r(4, 11), labels  # cross_entropy_sum


def _first_float(out: object) -> object:
    return out[0] if isinstance(out, (tuple, list)) else out


def run_check(
    name: str, ours: Callable, ref: Callable, atol: float = 2e-3, inputs: Optional[Callable[[], Tuple]] = None
) -> Optional[str]:
    """Forward and backward of ``ours`` and ``ref`` on a tiny fp32 input on the current device (``inputs()``
    where given, fresh for each; else the op's own below). The inputs are seeded; the random generators
    are restored afterwards, so the run's seeded stream (the check runs while the model is built) goes on
    as if the check had not run."""
    import paddle

    cpu = paddle.get_rng_state("cpu")
    cuda = paddle.get_cuda_rng_state() if paddle.is_compiled_with_cuda() else None
    try:
        return _compare(name, ours, ref, atol, inputs)
    finally:
        paddle.set_rng_state(cpu, "cpu")
        if cuda is not None:
            paddle.set_cuda_rng_state(cuda)


def _compare(
    name: str, ours: Callable, ref: Callable, atol: float, inputs: Optional[Callable[[], Tuple]]
) -> Optional[str]:
    import numpy as np
    import paddle

    results = []
    for fn in (ours, ref):
        args = inputs() if inputs is not None else _inputs(name)
        for a in args:
            if isinstance(a, paddle.Tensor) and a.dtype == paddle.float32:
                a.stop_gradient = False
        out = fn(*args)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        total = sum(o.astype("float32").sum() for o in outs if not o.stop_gradient)
        total.backward()
        grads = [a.grad.numpy() for a in args if isinstance(a, paddle.Tensor) and a.grad is not None]
        results.append([o.numpy() for o in outs] + grads)
    for got, want in zip(*results):
        if got.shape != want.shape or not np.allclose(got, want, atol=atol, rtol=atol):
            return "its result differs from the reference op"
    return None
