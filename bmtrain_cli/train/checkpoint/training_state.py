"""Saving and resuming training: a checkpoint step-N (weights, tokenizer, optimizer state, trainer state)
that survives kill -9, a full disk and a read-only directory.

The layout (names, ``latest``, the atomic directory write, stale temporaries) is checkpoint_layout.py's; the
optimizer state is optimizer_state.py's and the RNG state rng_state.py's. An OSError while saving (no space,
no permission) removes the temporary directory and raises :class:`CheckpointError` naming the cause and the
checkpoints that remain.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import paddle

from bmtrain_cli.checkpoint_layout import (
    NATIVE_WEIGHTS_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_SHARD,
    STATE_FILE,
    CheckpointError,
    atomic_directory,
    point_latest,
    shard_staging_dir,
    step_dirs,
    step_name,
)
from bmtrain_cli.errors import write_error_line
from bmtrain_cli.train.checkpoint.optimizer_state import (
    describe_layout,
    optimizer_layout,
    optimizer_state,
    restore_optimizer,
    same_layout,
    to_numpy,
)
from bmtrain_cli.train.checkpoint.rng_state import rng_state, set_rng_state

NOT_CARRIED = "optimizer state is not carried over; moments restart"

WeightsWriter = Callable[[paddle.nn.Layer, str], Any]


def save_native_weights(model: paddle.nn.Layer, out_dir: str) -> None:
    """Weights of a layer that is not one of our CausalLMs (tests, custom heads), by structured name."""
    from bmtrain_cli.models.safetensors_io import save_numpy_file

    save_numpy_file(
        {n: to_numpy(p) for n, p in model.state_dict().items()}, Path(out_dir) / NATIVE_WEIGHTS_FILE
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


def _save_failed(exc: Exception, root: Path, step: int, tmp_name: str) -> Exception:
    """The one line for a save that could not be written (the exception itself when it is no write
    failure); the earlier complete checkpoints are untouched and named."""
    from safetensors import SafetensorError

    if not isinstance(exc, (OSError, SafetensorError)):
        return exc
    where = getattr(exc, "filename", None) or root
    what = write_error_line(exc, where) or f"{getattr(exc, 'strerror', None) or exc} (while writing {where})"
    kept = [p.name for _, p in step_dirs(root)] if root.is_dir() else []
    return CheckpointError(
        f"could not save checkpoint step-{step} under {root}: {what}. "
        + (f"Earlier checkpoints are intact: {', '.join(kept)}." if kept else "No earlier checkpoint exists.")
        + " Free space or fix permissions, then resume with --resume."
    )


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
    """Write checkpoint ``step-<step>`` atomically (checkpoint_layout.atomic_directory), point ``latest``
    at it and prune to the newest ``keep``; returns its path.

    ``layout`` (:func:`optimizer_layout`) not portable: the per-rank optimizer parts written by
    :func:`write_optimizer_shard` are moved in (all of them must be there, else the checkpoint records
    that it carries no optimizer state); otherwise ``optimizer``'s whole state goes to optimizer.safetensors.
    """
    root = Path(root)
    final = root / step_name(step)
    tmp_name = f".tmp-step-{step}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final, tmp_name) as tmp:
            (weights_writer or default_weights_writer(model))(model, str(tmp))
            if tokenizer is not None:
                tokenizer.save(str(tmp))
            _write_optimizer_and_state(tmp, root, step, model, optimizer, state, layout)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
        point_latest(root, final)
    except Exception as exc:  # OSError, or safetensors' SafetensorError wrapping one
        raise _save_failed(exc, root, step, tmp_name) from None
    if keep:
        for _, path in step_dirs(root)[:-keep]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
    return final


def _write_optimizer_and_state(
    tmp: Path,
    root: Path,
    step: int,
    model: paddle.nn.Layer,
    optimizer: Any,
    state: Dict[str, Any],
    layout: Optional[Dict[str, Any]],
) -> None:
    """The optimizer file(s) and, last, trainer_state.json of the checkpoint being written in ``tmp``."""
    from bmtrain_cli.models.safetensors_io import save_numpy_file

    tensors, extra = optimizer_state(optimizer, model)
    layout = dict(layout or optimizer_layout(None))
    if layout["portable"]:
        save_numpy_file(tensors, tmp / OPTIMIZER_FILE)
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
    if not same_layout(saved, layout):
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
        state["rng_notes"] = set_rng_state(state["rng"])  # e.g. a resume on another number of GPUs
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
