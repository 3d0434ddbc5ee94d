"""Python, numpy and Paddle random generator states as JSON-friendly data (saved in trainer_state.json so
that a resumed run draws the same numbers as an uninterrupted one)."""

from __future__ import annotations

import random
from typing import Any, Dict, List

import numpy as np
import paddle

from bmtrain_cli.machine import gpu_available


def rng_state() -> Dict[str, Any]:
    """Python, numpy and Paddle generator states as JSON-friendly data."""
    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "python": _listify(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[_listify(x) for x in np_state[2:]]],
        "paddle": [list(_listify(s.__getstate__())) for s in paddle.get_rng_state()],
    }
    if gpu_available():
        state["paddle_cuda"] = [list(_listify(s.__getstate__())) for s in paddle.get_cuda_rng_state()]
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    if "python" in state:
        random.setstate(_tuplify(state["python"]))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s[0], np.asarray(s[1], dtype=np.uint32), *s[2:]))
    gen_cls = paddle.base.libpaddle.GeneratorState
    if state.get("paddle"):
        paddle.set_rng_state([_generator_state(gen_cls, s) for s in state["paddle"]])
    if state.get("paddle_cuda") and paddle.device.is_compiled_with_cuda():
        paddle.set_cuda_rng_state([_generator_state(gen_cls, s) for s in state["paddle_cuda"]])


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
