"""Checkpoints that survive kill -9, a full disk and a read-only directory.

Layout under ``output_dir/checkpoints``::

    step-N/
      config.json + model*.safetensors  Hugging Face layout (models.save_pretrained; load_pretrained reads it)
      tokenizer files                    (when a tokenizer is given)
      optimizer.safetensors              AdamW moments / beta powers / master weights, keyed by parameter name
      trainer_state.json                 step, schedule, loss scaler, RNG states, data position, counters
    latest                               text file naming the newest complete step-N

A save writes everything into a hidden temporary directory, fsyncs it, renames it to ``step-N`` and then
replaces ``latest`` atomically. A kill at any moment leaves either the old or the new checkpoint complete,
never a half-written one under a real name. An OSError (no space, no permission) removes the temporary
directory and raises :class:`CheckpointError` naming the cause and the checkpoints that remain.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import paddle

from bmtrain_cli.errors import UserError

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
NATIVE_WEIGHTS_FILE = "weights.safetensors"
LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d+)$")

WeightsWriter = Callable[[paddle.nn.Layer, str], Any]


class CheckpointError(UserError):
    """A checkpoint could not be written or read."""


# ----------------------------------------------------------------------------- discovery


def step_dirs(root: Path) -> List[Tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    out = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_latest(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is missing/stale."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except OSError:
            name = ""
        candidate = root / name
        if name and _STEP_RE.match(name) and (candidate / STATE_FILE).is_file():
            return candidate
    found = step_dirs(root)
    return found[-1][1] if found else None


def remove_stale_temporaries(root: Path) -> None:
    """Delete half-written saves left by a process killed mid-save."""
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(".tmp-") or child.name.startswith(".old-"):
                shutil.rmtree(child, ignore_errors=True)


# ----------------------------------------------------------------------------- fsync helpers


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            _fsync_file(Path(dirpath) / f)
        _fsync_dir(Path(dirpath))


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------- RNG state


def rng_state() -> Dict[str, Any]:
    """Python, numpy and Paddle generator states as JSON-friendly data."""
    np_state = np.random.get_state()
    state: Dict[str, Any] = {
        "python": _listify(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[_listify(x) for x in np_state[2:]]],
        "paddle": [list(_listify(s.__getstate__())) for s in paddle.get_rng_state()],
    }
    if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
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


# ----------------------------------------------------------------------------- optimizer state


def _param_names(model: paddle.nn.Layer) -> Dict[str, str]:
    """Paddle-internal parameter name -> structured name (stable across processes)."""
    return {p.name: n for n, p in model.named_parameters()}


def optimizer_state(optimizer: Any, model: paddle.nn.Layer) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """Split an optimizer state_dict into tensors keyed by structured parameter names and plain extras."""
    internal = _param_names(model)
    by_length = sorted(internal, key=len, reverse=True)
    tensors: Dict[str, np.ndarray] = {}
    extra: Dict[str, Any] = {}
    for key, value in optimizer.state_dict().items():
        if key == "master_weights":
            for pname, t in value.items():
                tensors[f"master_weights::{internal.get(pname, pname)}"] = _to_numpy(t)
        elif isinstance(value, paddle.Tensor):
            owner = next((p for p in by_length if key.startswith(p + "_")), None)
            if owner is None:
                tensors[f"::{key}"] = _to_numpy(value)
            else:
                tensors[f"{internal[owner]}::{key[len(owner) + 1 :]}"] = _to_numpy(value)
        elif key != "LR_Scheduler":  # the schedule is ours and lives in trainer_state.json
            extra[key] = value
    return tensors, extra


def restore_optimizer(optimizer: Any, model: paddle.nn.Layer, tensors: Dict[str, np.ndarray]) -> None:
    structured = {n: p.name for n, p in model.named_parameters()}
    state: Dict[str, Any] = {}
    masters: Dict[str, Any] = {}
    for key, arr in tensors.items():
        owner, _, acc = key.partition("::")
        if owner == "master_weights":
            masters[structured.get(acc, acc)] = paddle.to_tensor(arr)
        elif owner == "":
            state[acc] = paddle.to_tensor(arr)
        else:
            if owner not in structured:
                raise CheckpointError(
                    f"optimizer state names parameter {owner!r}, which this model does not have "
                    "(was the checkpoint written for another model?)"
                )
            state[f"{structured[owner]}_{acc}"] = paddle.to_tensor(arr)
    if masters:
        state["master_weights"] = masters
    optimizer.set_state_dict(state)


def _to_numpy(t: Any) -> np.ndarray:
    arr = t.numpy() if isinstance(t, paddle.Tensor) else np.asarray(t)
    return np.ascontiguousarray(arr)


# ----------------------------------------------------------------------------- weights for plain layers


def save_native_weights(model: paddle.nn.Layer, out_dir: str) -> None:
    """Weights of a layer that is not one of our CausalLMs (tests, custom heads), by structured name."""
    from safetensors.numpy import save_file

    save_file(
        {n: _to_numpy(p) for n, p in model.state_dict().items()}, os.path.join(out_dir, NATIVE_WEIGHTS_FILE)
    )


def load_native_weights(model: paddle.nn.Layer, ckpt_dir: Path) -> None:
    from safetensors.numpy import load_file

    arrays = load_file(str(Path(ckpt_dir) / NATIVE_WEIGHTS_FILE))
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in arrays.items()})


def default_weights_writer(model: paddle.nn.Layer) -> WeightsWriter:
    """models.save_pretrained for our CausalLM (it has ``arch``), the native writer otherwise."""
    if hasattr(model, "arch"):
        from bmtrain_cli.models import save_pretrained

        return lambda m, d: save_pretrained(m, d)
    return save_native_weights


# ----------------------------------------------------------------------------- save / load


def _describe(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied ({exc.strerror})"
    return exc.strerror or str(exc)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    model: paddle.nn.Layer,
    optimizer: Any,
    state: Dict[str, Any],
    tokenizer: Any = None,
    keep: Optional[int] = None,
    weights_writer: Optional[WeightsWriter] = None,
    extra_files: Optional[Dict[str, str]] = None,
) -> Path:
    """Write checkpoint ``step-<step>`` atomically and prune to the newest ``keep``; returns its path."""
    from safetensors.numpy import save_file

    root = Path(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        (weights_writer or default_weights_writer(model))(model, str(tmp))
        if tokenizer is not None:
            tokenizer.save(str(tmp))
        tensors, extra = optimizer_state(optimizer, model)
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        full_state = dict(state, step=step, optimizer_extra=_jsonable(extra), rng=rng_state())
        with open(tmp / STATE_FILE, "w", encoding="utf-8") as f:
            json.dump(full_state, f, indent=1)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        _fsync_tree(tmp)
        old = None
        if final.exists():  # re-saving a step (e.g. the final save right after a resume)
            old = root / f".old-step-{step}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_text_atomic(root / LATEST, final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for _, p in step_dirs(root)] if root.is_dir() else []
        where = exc.filename or str(tmp)
        raise CheckpointError(
            f"could not save checkpoint step-{step} under {root}: {_describe(exc)} (while writing {where}). "
            + (
                f"Earlier checkpoints are intact: {', '.join(kept)}."
                if kept
                else "No earlier checkpoint exists."
            )
            + " Free space or fix permissions, then resume with --resume."
        ) from None
    if keep:
        for _, path in step_dirs(root)[:-keep]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
    return final


def read_state(ckpt_dir: Path) -> Dict[str, Any]:
    path = Path(ckpt_dir) / STATE_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def load_training_state(
    ckpt_dir: Path, *, model: paddle.nn.Layer, optimizer: Any, restore_rng: bool = True
) -> Dict[str, Any]:
    """Restore optimizer state (and RNG) from a checkpoint; the weights are loaded by the caller
    (models.load_pretrained, or load_native_weights for plain layers). Returns trainer_state.json."""
    from safetensors.numpy import load_file

    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    opt_file = ckpt_dir / OPTIMIZER_FILE
    if not opt_file.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {OPTIMIZER_FILE}: not a training checkpoint")
    restore_optimizer(optimizer, model, load_file(str(opt_file)))
    if restore_rng and state.get("rng"):
        set_rng_state(state["rng"])
    return state


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, paddle.Tensor):
        return value.numpy().tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
