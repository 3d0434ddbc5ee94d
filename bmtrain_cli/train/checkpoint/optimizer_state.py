"""Optimizer state on disk: a state_dict keyed by structured parameter names (stable across processes and
layouts), the layout it is split by, and each rank's part under tensor/pipeline parallel or sharding."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle

from bmtrain_cli.checkpoint_layout import OPTIMIZER_SHARD, CheckpointError, fsync_file, shard_staging_dir
from bmtrain_cli.parallel.protocol import ParallelCtx


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
    return {k: to_numpy(v) for k, v in tensors.items()}, extra


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


def to_numpy(t: Any) -> np.ndarray:
    arr = t.numpy() if isinstance(t, paddle.Tensor) else np.asarray(t)
    return np.ascontiguousarray(arr)


# ----------------------------------------------------------------------------- optimizer layout


def optimizer_layout(ctx: Optional[ParallelCtx] = None) -> Dict[str, Any]:
    """The layout the optimizer state is split by. ``portable``: rank 0 holds the whole state (one
    process or plain data parallel, where every rank holds the same state), so any such layout can
    reuse it; otherwise each rank's part is saved and only the same layout can reuse it. ``ctx`` None:
    one process."""
    if ctx is None:
        one = ("world_size", "data_world", "tensor_parallel", "pipeline_parallel", "sharding_parallel")
        return {**dict.fromkeys(one, 1), "sharding_stage": 1, "portable": True}
    layout: Dict[str, Any] = {
        "world_size": int(ctx.world_size),
        "data_world": int(ctx.data_world),
        "tensor_parallel": int(ctx.tp_degree),
        "pipeline_parallel": int(ctx.pp_degree),
        "sharding_parallel": int(ctx.sharding_degree),
        "sharding_stage": int(ctx.config.parallel.sharding_stage) if ctx.config is not None else 1,
        # expert parallel: a rank's part holds the moments of its experts only
        "expert_parallel": int(ctx.expert_group.degree) if ctx.expert_group is not None else 1,
        "portable": bool(ctx.optimizer_state_portable),
    }
    bounds = ctx.pipeline_info.get("boundaries")
    if layout["pipeline_parallel"] > 1 and bounds:
        # a stage's optimizer part fits only the same cut (a rebalance moves it: train/loop/pipeline_rebalance.py)
        layout["pipeline_bounds"] = [int(b) for b in bounds]
    return layout


def describe_layout(layout: Optional[Dict[str, Any]]) -> str:
    if not layout:
        return "one process"
    parts = [
        f"{key} {layout.get(key, 1)}"
        for key in (
            "data_world",
            "tensor_parallel",
            "pipeline_parallel",
            "sharding_parallel",
            "expert_parallel",
        )
        if layout.get(key, 1) > 1
    ]
    if layout.get("sharding_parallel", 1) > 1:
        parts.append(f"sharding_stage {layout.get('sharding_stage', 1)}")
    if layout.get("pipeline_bounds"):
        parts.append(f"stage boundaries {layout['pipeline_bounds']}")
    return ", ".join(parts) if parts else "one process"


def same_layout(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    keys = ("world_size", "data_world", "tensor_parallel", "pipeline_parallel", "sharding_parallel")
    keys_stage = keys + ("sharding_stage", "expert_parallel")
    same_cut = not (a.get("pipeline_bounds") and b.get("pipeline_bounds")) or list(
        a["pipeline_bounds"]
    ) == list(b["pipeline_bounds"])
    return same_cut and all(int(a.get(k, 1)) == int(b.get(k, 1)) for k in keys_stage)


def write_optimizer_shard(root: Path, step: int, rank: int, optimizer: Any, model: paddle.nn.Layer) -> Path:
    """This rank's optimizer state, written atomically into the staging folder (all ranks, before the
    barrier that precedes rank 0's save_checkpoint)."""
    from bmtrain_cli.models.safetensors_io import save_numpy_file

    staging = shard_staging_dir(root, step)
    staging.mkdir(parents=True, exist_ok=True)
    final = staging / OPTIMIZER_SHARD.format(rank=rank)
    tmp = staging / f".{final.name}.tmp-{os.getpid()}"
    tensors, _ = optimizer_state(optimizer, model)
    save_numpy_file(tensors, tmp)
    fsync_file(tmp)
    os.replace(tmp, final)
    return final
