"""Dynamic pipeline load balancing (``parallel_config.pipeline_rebalance``).

While a pipeline-parallel run trains, forward hooks on every item of this rank's stage (embedding, each
decoder layer, final norm, head) time the item's first forward of every step (with a device synchronize
on both sides on a GPU, so the time is the item's compute; once per step, so the synchronizes cost
nothing worth counting). Every ``check_every`` steps the per-item medians of the window (robust to a
process being descheduled during one call) are gathered from all ranks, averaged over the ranks that hold
the item, summed per stage, and when the slowest stage takes more than ``threshold`` x the fastest
and :func:`pipeline.partition` finds a cut whose slowest stage is faster, the move is planned. At the next
checkpoint (the step the recipe has just saved) the stages are re-cut:

1. the weights and the optimizer state (moments, beta powers, master weights) of the parameters whose
   stage changes are sent, keyed by their single-process names, from the rank that trained them to the
   rank that will (one broadcast per tensor over the pipeline group);
2. the PipelineLayer is rebuilt from the same decoder with the new boundaries (``ctx.wrapping.wrap_model``),
   and fleet's optimizer wrapper, which holds no reference to the model, keeps stepping the same
   optimizer.

Every rank holds the whole decoder (the PipelineLayer keeps only its stage's items), so a rank that
receives a layer already has its parameters: only their values change. Training continues exactly: the
per-step losses equal a run that never moved (tests/integration/test_pipeline_rebalance.py).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel.full_weights import unwrap
from bmtrain_cli.parallel.pipeline import (
    imbalance,
    item_parameter_names,
    partition,
    stage_costs,
    stage_layers,
)
from bmtrain_cli.train.parts import Parts, TrainState

MONITOR_ATTR = "_bmtrain_stage_monitor"


@dataclasses.dataclass(frozen=True)
class Move:
    """A planned re-cut: boundaries before and after, the measured per-item seconds and stage ratios."""

    old: List[int]
    new: List[int]
    costs: List[float]  # forward seconds per item (median over the window's steps, one call each)
    ratio_before: float  # slowest / fastest stage, measured
    ratio_after: float  # slowest / fastest stage, predicted for ``new`` from the same costs


class StageMonitor:
    """Forward seconds of each item of this rank's stage, one call per step (``next_step`` re-arms),
    over the current window, and the move planned at the last check (None: none)."""

    def __init__(self, pipe: Any, first_item: int, synchronize: bool) -> None:
        self.synchronize = synchronize
        self.seconds: Dict[int, List[float]] = {}
        self.planned: Optional[Move] = None
        self._started: Dict[int, float] = {}
        self._armed: Set[int] = set()
        for offset, item in enumerate(pipe.run_function):
            index = first_item + offset
            item.register_forward_pre_hook(self._pre_hook(index))
            item.register_forward_post_hook(self._post_hook(index))
            self._armed.add(index)
        self._items = set(self._armed)

    def next_step(self) -> None:
        """Time each item's next forward again."""
        self._armed = set(self._items)

    def _now(self) -> float:
        if self.synchronize:
            import paddle

            paddle.device.synchronize()
        return time.perf_counter()

    def _pre_hook(self, index: int) -> Any:
        def hook(layer: Any, inputs: Any) -> None:
            if layer.training and index in self._armed:  # training forwards only (not an eval pass)
                self._armed.discard(index)
                self._started[index] = self._now()

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(layer: Any, inputs: Any, outputs: Any) -> None:
            started = self._started.pop(index, None)
            if started is not None:
                self.seconds.setdefault(index, []).append(self._now() - started)

        return hook

    def take(self) -> Dict[int, float]:
        """Median seconds per forward of each timed item over the window, which starts again."""
        medians = {i: float(np.median(times)) for i, times in self.seconds.items() if times}
        self.seconds = {}
        return medians


def monitor_of(parts: Parts) -> StageMonitor:
    """The pipeline's monitor, attached (hooks registered) on the first call after it was built."""
    pipe = unwrap(parts.model.wrapped)
    monitor = getattr(pipe, MONITOR_ATTR, None)
    if monitor is None:
        first = int(parts.ctx.pipeline_info["boundaries"][parts.ctx.pp_rank])
        if len(pipe.run_function) != parts.ctx.pipeline_info["boundaries"][parts.ctx.pp_rank + 1] - first:
            raise RuntimeError("the pipeline stage's run functions do not match its items")
        monitor = StageMonitor(pipe, first, synchronize=not parts.ctx.on_cpu)
        object.__setattr__(pipe, MONITOR_ATTR, monitor)
    return monitor


def rebalance_if_due(parts: Parts, state: TrainState) -> Parts:
    """Call after every step (collective on check steps): checks the stage times every check_every
    steps and, on the step just saved, moves the boundaries when a check planned it. Returns ``parts``,
    or new Parts with the re-cut model."""
    settings = parts.config.parallel.pipeline_rebalance
    if not settings.enabled or parts.ctx.pp_degree == 1:
        return parts
    if state.step >= parts.runtime.total_steps:
        return parts  # the last checkpoint is written after the loop: no move left to make
    monitor = monitor_of(parts)
    monitor.next_step()
    if state.step % settings.check_every == 0:
        monitor.planned = plan(parts, monitor.take(), settings.threshold, state.step)
    if monitor.planned is not None and state.last_saved_step == state.step:
        return repartition(parts, monitor.planned, state.step)
    return parts


def _gathered_costs(parts: Parts, local: Dict[int, float]) -> List[float]:
    """Per-item seconds averaged over every rank that timed the item (collective over the whole world, so
    every rank reaches the same decision)."""
    import paddle.distributed as dist

    reports: List[Any] = []
    dist.all_gather_object(reports, local)
    n_items = int(parts.ctx.pipeline_info["boundaries"][-1])
    sums, counts = [0.0] * n_items, [0] * n_items
    for report in reports:
        for index, seconds in report.items():
            sums[int(index)] += float(seconds)
            counts[int(index)] += 1
    return [s / c if c else 0.0 for s, c in zip(sums, counts)]


def slowest_over_fastest(costs: Sequence[float], bounds: Sequence[int]) -> float:
    per = stage_costs(costs, bounds)
    return max(per) / min(per) if min(per) > 0 else float("inf")


def plan(parts: Parts, local: Dict[int, float], threshold: float, step: int) -> Optional[Move]:
    """The move the measured window asks for (None when the stages are within ``threshold`` or no cut
    has a faster slowest stage)."""
    costs = _gathered_costs(parts, local)
    old = [int(b) for b in parts.ctx.pipeline_info["boundaries"]]
    ratio = slowest_over_fastest(costs, old)
    if ratio <= threshold:
        return None
    new = partition(costs, parts.ctx.pp_degree)
    if new == old or max(stage_costs(costs, new)) >= max(stage_costs(costs, old)):
        return None
    move = Move(
        old=old, new=new, costs=costs, ratio_before=ratio, ratio_after=slowest_over_fastest(costs, new)
    )
    layers = parts.model.raw.arch.num_hidden_layers
    parts.console.say(
        f"step {step}: pipeline stages unequal (slowest/fastest forward {ratio:.2f}x > {threshold}); "
        f"decoder layers per stage {stage_layers(old, layers)} -> {stage_layers(new, layers)} at the next "
        "checkpoint"
    )
    return move


def repartition(parts: Parts, move: Move, step: int) -> Parts:
    """Re-cut the pipeline at ``move.new`` (collective), carrying weights and optimizer state."""
    ctx, model = parts.ctx, parts.model
    started = time.perf_counter()
    moved = carry_moved_state(parts, move.old, move.new)
    for p in model.raw.parameters():  # the new stage starts without gradients (none left on moved ones)
        p.clear_gradient(False)
    wrapped = ctx.wrapping.wrap_model(model.raw, pipeline_costs=move.costs)
    layers = model.raw.arch.num_hidden_layers
    per_before = stage_costs(move.costs, move.old)
    per_after = stage_costs(move.costs, move.new)
    parts.console.say(
        f"step {step}: pipeline rebalanced: decoder layers per stage {stage_layers(move.old, layers)} -> "
        f"{stage_layers(move.new, layers)}; measured forward ms per stage "
        f"{[round(1e3 * c, 2) for c in per_before]} (slowest/fastest {move.ratio_before:.2f}x) -> predicted "
        f"{[round(1e3 * c, 2) for c in per_after]} ({move.ratio_after:.2f}x); {moved} tensors moved in "
        f"{time.perf_counter() - started:.2f} s"
    )
    parts.metrics.log_event(
        step,
        "pipeline_rebalance",
        old_boundaries=move.old,
        new_boundaries=move.new,
        old_stage_layers=stage_layers(move.old, layers),
        new_stage_layers=stage_layers(move.new, layers),
        stage_forward_s=per_before,
        predicted_stage_forward_s=per_after,
        imbalance=move.ratio_before,
        predicted_imbalance=move.ratio_after,
        imbalance_max_over_mean=imbalance(move.costs, move.old),
        item_forward_s=move.costs,
    )
    return dataclasses.replace(parts, model=dataclasses.replace(model, wrapped=wrapped))


def resumed_cut(config: Config, checkpoint: Optional[Path]) -> Optional[List[int]]:
    """With pipeline_rebalance on, a resume continues from the cut its checkpoint was saved under (where
    each rank's optimizer part belongs); None otherwise (pipeline_partition decides)."""
    if (
        checkpoint is None
        or config.parallel.pipeline_parallel == 1
        or not config.parallel.pipeline_rebalance.enabled
    ):
        return None
    from bmtrain_cli.train.checkpoint.training_state import read_state

    bounds = (read_state(Path(checkpoint)).get("optimizer_layout") or {}).get("pipeline_bounds")
    return [int(b) for b in bounds] if bounds else None


def stages_of(names: List[List[str]], bounds: Sequence[int]) -> Dict[str, Set[int]]:
    """The stages holding each parameter (a tied weight is on two) when cut at ``bounds``."""
    where: Dict[str, Set[int]] = {}
    for stage in range(len(bounds) - 1):
        for item in range(bounds[stage], bounds[stage + 1]):
            for name in names[item]:
                where.setdefault(name, set()).add(stage)
    return where


def transfers(names: List[List[str]], old: Sequence[int], new: Sequence[int]) -> List[Tuple[str, int, int]]:
    """(parameter, stage sending it, stage receiving it) for every parameter a new stage lacks."""
    before, after = stages_of(names, old), stages_of(names, new)
    return sorted(
        (name, min(before[name]), stage) for name, stages in after.items() for stage in stages - before[name]
    )


def carry_moved_state(parts: Parts, old: Sequence[int], new: Sequence[int]) -> int:
    """Send the weights and optimizer tensors of the parameters that change stage to their new stage
    (collective over the pipeline group); returns the number of tensors sent."""
    import paddle
    import paddle.distributed as dist

    from bmtrain_cli.train.checkpoint.optimizer_state import internal_optimizer_state, optimizer_tensors

    ctx, raw, base = parts.ctx, parts.model.raw, parts.optim.base
    group = ctx.hcg.get_pipe_parallel_group()
    moves = transfers(item_parameter_names(raw), old, new)
    params = dict(raw.named_parameters())
    sending = {name for name, src, _ in moves if src == ctx.pp_rank}
    outgoing: Dict[str, Any] = {name: params[name] for name in sending}
    if sending:
        opt, _ = optimizer_tensors(base, raw)
        for key, value in opt.items():
            owner, _, acc = key.partition("::")
            if (acc if owner == "master_weights" else owner) in sending:
                outgoing[key] = value
    # what each stage sends: key -> (shape, dtype, kept on the host), so the receivers can allocate
    meta = {
        key: (list(t.shape), str(t.dtype).replace("paddle.", ""), t.place.is_cpu_place())
        for key, t in outgoing.items()
    }
    metas: List[Any] = []
    dist.all_gather_object(metas, meta, group=group)
    receivers = {name: {dst for n, _, dst in moves if n == name} for name, _, _ in moves}
    weights: Dict[str, Any] = {}
    optimizer: Dict[str, Any] = {}
    count = 0
    for stage, stage_meta in enumerate(metas):
        for key in sorted(stage_meta):
            shape, dtype, on_host = stage_meta[key]
            if stage == ctx.pp_rank:
                buf = outgoing[key].detach()
                if not ctx.on_cpu and buf.place.is_cpu_place():
                    buf = buf.cuda()  # e.g. Adam's beta powers, kept on the host
            else:
                buf = paddle.empty(shape, dtype=dtype)
            dist.broadcast(buf, src=group.ranks[stage], group=group)
            count += 1
            owner, sep, acc = key.partition("::")
            name = (acc if owner == "master_weights" else owner) if sep else key
            if ctx.pp_rank not in receivers.get(name, set()):
                continue
            if on_host and not buf.place.is_cpu_place():
                buf = buf.cpu()  # where the sender kept it (the optimizer's placement is unchanged)
            if sep:
                optimizer[key] = buf
            else:
                weights[key] = buf
    for name, value in weights.items():
        params[name].set_value(value)
    if optimizer:
        merged = base.state_dict()
        received = internal_optimizer_state(raw, optimizer)
        masters = received.pop("master_weights", {})
        merged.update(received)
        if masters:
            merged["master_weights"] = {**merged.get("master_weights", {}), **masters}
        base.set_state_dict(merged)
    if hasattr(base, "sync_from_model"):  # offloaded optimizer: its host copies of the weights
        base.sync_from_model()
    return count
