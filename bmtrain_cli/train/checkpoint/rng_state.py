"""Python, numpy and Paddle random generator states as JSON-friendly data (saved in trainer_state.json so
that a resumed run draws the same numbers as an uninterrupted one)."""

from __future__ import annotations

import random
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import paddle

from bmtrain_cli.machine import gpu_available


def rng_state() -> Dict[str, Any]:
    """Python, numpy and Paddle generator states as JSON-friendly data: Paddle's CPU generator always
    (``paddle.get_rng_state()`` alone returns the current device's generators, so on a GPU the CPU one
    would be lost), and on a GPU build one state per visible CUDA device."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the global MT19937 generator's legacy state
    state: Dict[str, Any] = {
        "python": _listify(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[_listify(x) for x in np_state[2:]]],
        "paddle": [list(_listify(s.__getstate__())) for s in paddle.get_rng_state("cpu")],
    }
    if gpu_available():
        state["paddle_cuda"] = [list(_listify(s.__getstate__())) for s in paddle.get_cuda_rng_state()]
    return state


def fitting_states(saved: Sequence[Any], device_count: int) -> List[Tuple[int, Any]]:
    """(device index, saved state) for the devices this process sees: all of them when the counts match,
    else the first ``min`` of both (a resume on a different number of GPUs: Paddle's
    ``set_cuda_rng_state`` refuses a list of another length; the unmatched devices keep their seeds)."""
    return list(enumerate(saved[: max(device_count, 0)]))


def set_rng_state(state: Dict[str, Any]) -> List[str]:
    """Restore what was saved; returns notes on what could not be restored as it was."""
    notes: List[str] = []
    if "python" in state:
        random.setstate(_tuplify(state["python"]))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s[0], np.asarray(s[1], dtype=np.uint32), *s[2:]))
    gen_cls = paddle.base.libpaddle.GeneratorState
    if state.get("paddle"):
        cpu = [_generator_state(gen_cls, s) for s in state["paddle"]]
        paddle.set_rng_state(cpu[:1], device="cpu")
    saved_cuda = state.get("paddle_cuda") or []
    if saved_cuda and paddle.device.is_compiled_with_cuda():
        from paddle.base import core

        count = paddle.device.cuda.device_count()
        for i, data in fitting_states(saved_cuda, count):
            core.default_cuda_generator(i).set_state(_generator_state(gen_cls, data))
        if count != len(saved_cuda):
            notes.append(
                f"the checkpoint holds {len(saved_cuda)} CUDA generator states and this process sees "
                f"{count} GPUs: restored {min(count, len(saved_cuda))}, the others keep their seeds"
            )
    return notes


def _generator_state(cls: Any, data: List[Any]) -> Any:
    st = cls.__new__(cls)
    st.__setstate__(tuple(data))
    return st


def _listify(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_listify(v) for v in x]
    return x


def _tuplify(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_tuplify(v) for v in x)
    return x
