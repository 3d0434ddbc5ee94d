"""Checkpoints that survive kill -9, a full disk and a read-only directory.

Layout under ``output_dir/checkpoints``::

    step-N/
      config.json + model*.safetensors  Hugging Face layout (models.save_pretrained; load_pretrained reads it)
      tokenizer files                    (when a tokenizer is given)
      optimizer.safetensors              AdamW moments / beta powers / master weights, keyed by parameter name
                                         (the whole state: single process or plain data parallel)
      optimizer-rank-R.safetensors       instead, one per rank when the state is split (tensor/pipeline
                                         parallel, sharding); reused only under the same layout
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
OPTIMIZER_SHARD = "optimizer-rank-{rank}.safetensors"
NOT_CARRIED = "optimizer state is not carried over; moments restart"
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
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is missing/stale.
    A pointer naming a step directory that exists but lacks trainer_state.json is refused: a save never
    leaves one (it renames a complete directory into place), so it was damaged, and silently continuing
    from an older step would hide that."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, ValueError):
            name = ""
        candidate = root / name
        if name and _STEP_RE.match(name) and (candidate / STATE_FILE).is_file():
            return candidate
        if name and _STEP_RE.match(name) and candidate.is_dir():
            raise CheckpointError(
                f"{pointer} names {name}, which has no {STATE_FILE}: the checkpoint is damaged; resume from "
                "an earlier one with train_config.resume: PATH/step-N, or start over"
            )
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


def optimizer_tensors(optimizer: Any, model: paddle.nn.Layer) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Split an optimizer state_dict into its tensors, keyed ``structured parameter name::accumulator``
    (``master_weights::name``; ``::key`` for a tensor of no parameter), and plain extras."""
    internal = _param_names(model)
    by_length = sorted(internal, key=len, reverse=True)
    tensors: Dict[str, Any] = {}
    extra: Dict[str, Any] = {}
    for key, value in optimizer.state_dict().items():
        if key == "master_weights":
            for pname, t in value.items():
                tensors[f"master_weights::{internal.get(pname, pname)}"] = t
        elif isinstance(value, paddle.Tensor):
            owner = next((p for p in by_length if key.startswith(p + "_")), None)
            if owner is None:
                tensors[f"::{key}"] = value
            else:
                tensors[f"{internal[owner]}::{key[len(owner) + 1 :]}"] = value
        elif key != "LR_Scheduler":  # the schedule is ours and lives in trainer_state.json
            extra[key] = value
    return tensors, extra


def optimizer_state(optimizer: Any, model: paddle.nn.Layer) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """:func:`optimizer_tensors` as numpy arrays (what a checkpoint writes)."""
    tensors, extra = optimizer_tensors(optimizer, model)
    return {k: _to_numpy(v) for k, v in tensors.items()}, extra


def internal_optimizer_state(model: paddle.nn.Layer, tensors: Dict[str, Any]) -> Dict[str, Any]:
    """The inverse of :func:`optimizer_tensors`: a state_dict under this process's parameter names
    (numpy arrays become tensors), for ``optimizer.set_state_dict``."""
    structured = {n: p.name for n, p in model.named_parameters()}
    state: Dict[str, Any] = {}
    masters: Dict[str, Any] = {}
    for key, value in tensors.items():
        t = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
        owner, _, acc = key.partition("::")
        if owner == "master_weights":
            masters[structured.get(acc, acc)] = t
        elif owner == "":
            state[acc] = t
        else:
            if owner not in structured:
                raise CheckpointError(
                    f"optimizer state names parameter {owner!r}, which this model does not have "
                    "(was the checkpoint written for another model?)"
                )
            state[f"{structured[owner]}_{acc}"] = t
    if masters:
        state["master_weights"] = masters
    return state


def restore_optimizer(optimizer: Any, model: paddle.nn.Layer, tensors: Dict[str, np.ndarray]) -> None:
    optimizer.set_state_dict(internal_optimizer_state(model, tensors))


def _to_numpy(t: Any) -> np.ndarray:
    arr = t.numpy() if isinstance(t, paddle.Tensor) else np.asarray(t)
    return np.ascontiguousarray(arr)


# ----------------------------------------------------------------------------- optimizer layout


def optimizer_layout(ctx: Any = None) -> Dict[str, Any]:
    """The layout the optimizer state is split by. ``portable``: rank 0 holds the whole state (one
    process or plain data parallel, where every rank holds the same state), so any such layout can
    reuse it; otherwise each rank's part is saved and only the same layout can reuse it."""
    config = getattr(ctx, "config", None)
    par = getattr(config, "parallel", None)
    layout = {
        "world_size": int(getattr(ctx, "world_size", 1)),
        "data_world": int(getattr(ctx, "data_world", 1)),
        "tensor_parallel": int(getattr(ctx, "tp_degree", 1)),
        "pipeline_parallel": int(getattr(ctx, "pp_degree", 1)),
        "sharding_parallel": int(getattr(ctx, "sharding_degree", 1)),
        "sharding_stage": int(getattr(par, "sharding_stage", 1)) if par is not None else 1,
    }
    portable = getattr(ctx, "optimizer_state_portable", None)
    layout["portable"] = bool(portable) if portable is not None else True
    bounds = (getattr(ctx, "pipeline_info", None) or {}).get("boundaries")
    if layout["pipeline_parallel"] > 1 and bounds:
        # a stage's optimizer part fits only the same cut (a rebalance moves it: parallel/rebalance.py)
        layout["pipeline_bounds"] = [int(b) for b in bounds]
    return layout


def describe_layout(layout: Optional[Dict[str, Any]]) -> str:
    if not layout:
        return "one process"
    parts = [
        f"{key} {layout.get(key, 1)}"
        for key in ("data_world", "tensor_parallel", "pipeline_parallel", "sharding_parallel")
        if layout.get(key, 1) > 1
    ]
    if layout.get("sharding_parallel", 1) > 1:
        parts.append(f"sharding_stage {layout.get('sharding_stage', 1)}")
    if layout.get("pipeline_bounds"):
        parts.append(f"stage boundaries {layout['pipeline_bounds']}")
    return ", ".join(parts) if parts else "one process"


def _same_layout(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    keys = ("world_size", "data_world", "tensor_parallel", "pipeline_parallel", "sharding_parallel")
    keys_stage = keys + ("sharding_stage",)
    same_cut = not (a.get("pipeline_bounds") and b.get("pipeline_bounds")) or list(
        a["pipeline_bounds"]
    ) == list(b["pipeline_bounds"])
    return same_cut and all(int(a.get(k, 1)) == int(b.get(k, 1)) for k in keys_stage)


def shard_staging_dir(root: Path, step: int) -> Path:
    """Where every rank puts its optimizer part before rank 0 assembles checkpoint step-<step>."""
    return Path(root) / f".tmp-optim-step-{step}"


def write_optimizer_shard(root: Path, step: int, rank: int, optimizer: Any, model: paddle.nn.Layer) -> Path:
    """This rank's optimizer state, written atomically into the staging folder (all ranks, before the
    barrier that precedes rank 0's save_checkpoint)."""
    from safetensors.numpy import save_file

    staging = shard_staging_dir(root, step)
    staging.mkdir(parents=True, exist_ok=True)
    final = staging / OPTIMIZER_SHARD.format(rank=rank)
    tmp = staging / f".{final.name}.tmp-{os.getpid()}"
    tensors, _ = optimizer_state(optimizer, model)
    save_file(tensors, str(tmp))
    _fsync_file(tmp)
    os.replace(tmp, final)
    return final


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
    layout: Optional[Dict[str, Any]] = None,
) -> Path:
    """Write checkpoint ``step-<step>`` atomically and prune to the newest ``keep``; returns its path.

    ``layout`` (:func:`optimizer_layout`) not portable: the per-rank optimizer parts written by
    :func:`write_optimizer_shard` are moved in (all of them must be there, else the checkpoint records
    that it carries no optimizer state); otherwise ``optimizer``'s whole state goes to optimizer.safetensors.
    """
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
        layout = dict(layout or optimizer_layout(None))
        if layout["portable"]:
            save_file(tensors, str(tmp / OPTIMIZER_FILE))
            layout["optimizer_files"] = [OPTIMIZER_FILE]
        else:
            staging = shard_staging_dir(root, step)
            names = [OPTIMIZER_SHARD.format(rank=r) for r in range(layout["world_size"])]
            if all((staging / n).is_file() for n in names):
                for n in names:
                    shutil.copyfile(staging / n, tmp / n)
                layout["optimizer_files"] = names
            else:  # e.g. ranks on other nodes without a shared output_dir
                layout["optimizer_files"] = []
            shutil.rmtree(staging, ignore_errors=True)
        full_state = dict(
            state, step=step, optimizer_extra=_jsonable(extra), optimizer_layout=layout, rng=rng_state()
        )
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
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or UTF-8
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path}: not a trainer state (no integer step); the checkpoint is damaged")
    return state


def optimizer_file_for(
    ckpt_dir: Path, state: Dict[str, Any], layout: Dict[str, Any], rank: int
) -> Tuple[Optional[Path], str]:
    """(optimizer file this rank restores, or None with the reason it cannot)."""
    saved = state.get("optimizer_layout")
    if saved is None or saved.get("portable", True):  # the whole state (older checkpoints: always)
        if not layout.get("portable", True):
            return None, (
                f"the checkpoint holds the whole optimizer state (saved under {describe_layout(saved)}) and "
                f"this run splits it ({describe_layout(layout)})"
            )
        return Path(ckpt_dir) / OPTIMIZER_FILE, ""
    if not _same_layout(saved, layout):
        return None, (
            f"the checkpoint's optimizer state is split for {describe_layout(saved)} and this run uses "
            f"{describe_layout(layout)}"
        )
    name = OPTIMIZER_SHARD.format(rank=rank)
    if name not in saved.get("optimizer_files", []):
        return None, f"the checkpoint was saved without the per-rank optimizer files ({name} is missing)"
    return Path(ckpt_dir) / name, ""


def load_training_state(
    ckpt_dir: Path,
    *,
    model: paddle.nn.Layer,
    optimizer: Any,
    restore_rng: bool = True,
    layout: Optional[Dict[str, Any]] = None,
    rank: int = 0,
) -> Dict[str, Any]:
    """Restore optimizer state (and RNG) from a checkpoint; the weights are loaded by the caller
    (models.load_pretrained, or load_native_weights for plain layers). Returns trainer_state.json with
    ``optimizer_restored`` (bool) and, when False, ``optimizer_message`` saying why."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    opt_file, reason = optimizer_file_for(ckpt_dir, state, layout or optimizer_layout(None), rank)
    if opt_file is None:
        state["optimizer_restored"] = False
        state["optimizer_message"] = f"{NOT_CARRIED}: {reason}"
    else:
        if not opt_file.is_file():
            raise CheckpointError(f"{ckpt_dir} has no {opt_file.name}: not a training checkpoint")
        try:
            tensors = load_file(str(opt_file))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(
                f"{opt_file}: unreadable or truncated optimizer state ({exc}); resume from an earlier "
                "checkpoint (train_config.resume: PATH) or start over"
            ) from None
        restore_optimizer(optimizer, model, tensors)
        state["optimizer_restored"] = True
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
