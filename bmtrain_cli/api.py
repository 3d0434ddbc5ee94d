"""The Python API on a user's own model: init_distributed, DataParallel, TensorParallel, PipelineParallel
and train_step.

These are thin layers over the engine that ``bmtrain train`` runs. ``init_distributed`` turns the degrees
into a parallel_config and starts fleet through ``parallel.topology.start_fleet`` (the CPU compatibility
layer included), returning the same ParallelContext the trainer uses. The wrappers put fleet's own pieces
into the user's model: ``TensorParallel`` replaces ``paddle.nn.Linear``/``paddle.nn.Embedding`` layers by
ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding holding slices of the original weights,
``PipelineParallel`` cuts a Sequential (or a model's one LayerList) into a fleet PipelineLayer at the
boundaries of ``parallel.pipeline.partition``. ``train_step`` reduces gradients through
``ParallelContext.wrap_optimizer`` (plain data parallel: summed over the data ranks; otherwise fleet's
hybrid-parallel optimizer, whose clip measures the global norm over shards and stages).

Loss convention: ``loss_fn(output, labels)`` returns the mean over the rows of ``labels`` (first axis).
Each data rank passes its own rows; ``train_step`` weights every rank's loss by its share of the global
batch, so gradients and the returned loss are those of one process on the concatenated batch.

Every rank builds the whole model after ``init_distributed`` (which seeds Paddle, numpy and random
identically on every rank); the wrappers broadcast it from the first rank of each group before cutting
it, so the starting weights are rank 0's whatever the user's initialisation does.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

from bmtrain_cli.errors import UserError

if TYPE_CHECKING:
    from bmtrain_cli.parallel.context import ParallelContext

KINDS = ("column", "row", "vocab", "replicate")
PARTITIONS = ("uniform", "parameters", "measured")
_SPEC_ATTR = "_bmtrain_parallel"  # the wrappers applied to a model (a _Spec)
_WRAPPED_ATTR = "_bmtrain_wrapped"  # an optimizer's gradient-reducing wrapper, built on first use

_CTX: Optional[ParallelContext] = None
_LAYOUT: Optional[Dict[str, int]] = None


# --------------------------------------------------------------------------- initialisation


def init_distributed(
    data_parallel: Optional[int] = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sharding_parallel: int = 1,
    seed: int = 0,
) -> ParallelContext:
    """Set up this process's place in the launched world (``python -m paddle.distributed.launch`` or
    ``fleetrun``; one process without a launcher) and return its ParallelContext (ranks, groups).

    ``data_parallel`` defaults to the processes left after tensor x pipeline x sharding. Seeds Paddle,
    numpy and random with ``seed`` on every rank (fleet's model-parallel generator gets a per-rank seed
    derived from it), so models built afterwards start identical everywhere."""
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.parallel.context import ParallelContext, launched_world_size

    global _CTX, _LAYOUT
    degrees = {
        "tensor_parallel": tensor_parallel,
        "pipeline_parallel": pipeline_parallel,
        "sharding_parallel": sharding_parallel,
    }
    if data_parallel is not None:
        degrees["data_parallel"] = data_parallel
    for name, value in degrees.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"init_distributed: {name} must be a positive integer, got {value!r}")
    world = launched_world_size()
    model_ranks = tensor_parallel * pipeline_parallel * sharding_parallel
    if data_parallel is None:
        if world % model_ranks:
            raise UserError(
                f"init_distributed: {world} launched process(es) cannot be split into groups of tensor "
                f"{tensor_parallel} x pipeline {pipeline_parallel} x sharding {sharding_parallel} = "
                f"{model_ranks}; launch a multiple of {model_ranks} processes"
            )
        data_parallel = world // model_ranks
    layout = {"data_parallel": data_parallel, **degrees, "seed": seed}
    if _CTX is not None:
        if layout != _LAYOUT:
            raise UserError(
                f"init_distributed was already called with {_LAYOUT}; cannot re-initialise as {layout}"
            )
        return _CTX
    if data_parallel * model_ranks != world:
        raise UserError(
            f"init_distributed: data {data_parallel} x tensor {tensor_parallel} x pipeline {pipeline_parallel}"
            f" x sharding {sharding_parallel} = {data_parallel * model_ranks} processes, but {world} were "
            "launched (python -m paddle.distributed.launch --nproc_per_node N)"
        )
    layout.pop("seed")
    config = Config.model_validate({"parallel_config": layout})
    if world == 1:
        ctx = ParallelContext(config=config)
    else:
        _check_gloo_groups(config)
        from bmtrain_cli.parallel.topology import start_fleet

        ctx = start_fleet(config)
    _seed_everything(ctx, seed)
    _CTX, _LAYOUT = ctx, {**layout, "seed": seed}
    return ctx


def _check_gloo_groups(config: Any) -> None:
    """The CPU build's gloo cannot connect a group of 3+ ranks that is not the whole world (the same
    refusal as validate-config / bmtrain run, config/checks.py)."""
    from bmtrain_cli.config.checks import cpu_gloo_subgroups
    from bmtrain_cli.config.env import paddle_has_gpu

    par = config.parallel
    if par.world_size > 2 and not paddle_has_gpu():
        groups = cpu_gloo_subgroups(par)
        if groups:
            raise UserError(
                f"init_distributed: this layout needs process groups of {' and '.join(groups)} ranks inside "
                f"a world of {par.world_size}; Paddle's CPU build (gloo) cannot connect a group of 3 or more "
                "ranks that is not the whole world (use degrees of 2 beside each other, or one degree equal "
                "to the world size)"
            )


def _seed_everything(ctx: ParallelContext, seed: int) -> None:
    import random

    import numpy as np
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)  # fleet.init re-seeds Paddle at random under tensor parallel: seed after it
    if ctx.tp_degree > 1:
        from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker

        tracker = get_rng_state_tracker()
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, seed + 1 + ctx.tp_rank * ctx.pp_degree + ctx.pp_rank)


def _context(caller: str) -> ParallelContext:
    if _CTX is None:
        raise UserError(f"{caller}: call bmtrain_cli.init_distributed() first")
    return _CTX


@dataclass(frozen=True)
class DistributedMode:
    """What init_distributed_mode reports for this rank."""

    rank: int
    world_size: int
    local_rank: int
    device_kind: str  # "gpu" or "cpu"
    device_count: int  # visible GPUs, or CPU cores on a machine without one
    backend: str  # "nccl" or "gloo" ("none" in one process)
    data_parallel: int
    tensor_parallel: int
    pipeline_parallel: int
    sharding_parallel: int
    data_rank: int
    tensor_rank: int
    pipeline_stage: int
    paddle_version: str
    paddle_build: str  # "CUDA 12.6" or "CPU", and the commit

    def __str__(self) -> str:
        unit = "GPU(s)" if self.device_kind == "gpu" else "CPU core(s)"
        return (
            f"rank {self.rank} of {self.world_size} (local {self.local_rank}): {self.device_count} {unit}, "
            f"backend {self.backend}; data {self.data_parallel} x tensor {self.tensor_parallel} x pipeline "
            f"{self.pipeline_parallel} x sharding {self.sharding_parallel} (data rank {self.data_rank}, "
            f"tensor rank {self.tensor_rank}, stage {self.pipeline_stage}); Paddle {self.paddle_version} "
            f"({self.paddle_build})"
        )


def init_distributed_mode() -> DistributedMode:
    """Initialise with the defaults when init_distributed was not called, print this rank's view (rank,
    world size, devices, degrees, Paddle build) and return it."""
    import paddle

    from bmtrain_cli.config.env import gpu_available

    ctx = _CTX if _CTX is not None else init_distributed()
    par = ctx.config.parallel
    gpu = gpu_available()
    cuda = paddle.version.cuda()
    build = f"CUDA {cuda}" if paddle.device.is_compiled_with_cuda() and cuda != "False" else "CPU"
    mode = DistributedMode(
        rank=ctx.rank,
        world_size=ctx.world_size,
        local_rank=int(os.environ.get("PADDLE_LOCAL_RANK", "0")),
        device_kind="gpu" if gpu else "cpu",
        device_count=paddle.device.cuda.device_count() if gpu else (os.cpu_count() or 1),
        backend=("nccl" if gpu else "gloo") if ctx.world_size > 1 else "none",
        data_parallel=par.data_parallel,
        tensor_parallel=par.tensor_parallel,
        pipeline_parallel=par.pipeline_parallel,
        sharding_parallel=par.sharding_parallel,
        data_rank=ctx.data_rank,
        tensor_rank=ctx.tp_rank,
        pipeline_stage=ctx.pp_rank,
        paddle_version=paddle.__version__,
        paddle_build=f"{build}, commit {paddle.version.commit[:10]}",
    )
    print(mode, flush=True)
    return mode


# --------------------------------------------------------------------------- what the wrappers record


@dataclass
class _Spec:
    tensor_parallel: bool = False
    loss_fn: Optional[Callable[[Any, Any], Any]] = None  # PipelineParallel's, used when train_step gets None
    pipeline: Optional[_PipelineLoss] = None  # the pipeline's loss hook when PipelineParallel cut the model


def _spec(model: Any) -> _Spec:
    spec = getattr(model, _SPEC_ATTR, None)
    if spec is None:
        spec = _Spec()
        object.__setattr__(model, _SPEC_ATTR, spec)
    return spec


def _broadcast_parameters(model: Any, group: Any) -> None:
    """Every rank of ``group`` takes the group's first rank's parameters."""
    import paddle
    import paddle.distributed as dist

    with paddle.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=group.ranks[0], group=group)


# --------------------------------------------------------------------------- data parallel


def DataParallel(model: Any, group_size: Optional[int] = None, sharding_stage: Optional[int] = None) -> Any:  # noqa: N802
    """Replicate ``model`` over the data ranks: parameters broadcast from the group's first rank;
    train_step sums the gradients over the group. ``group_size`` (checked) is the number of data ranks,
    data_parallel x sharding_parallel of init_distributed. ``sharding_stage=1`` asserts that the
    optimizer state is split over sharding_parallel ranks (fleet's sharding optimizer); stages 2/3 are
    available through ``bmtrain train`` (parallel_config.sharding_stage) only."""
    ctx = _context("DataParallel")
    par = ctx.config.parallel
    if group_size is not None and group_size != ctx.data_world:
        raise UserError(
            f"DataParallel(group_size={group_size}) but init_distributed set up {ctx.data_world} data "
            f"rank(s) (data_parallel {par.data_parallel} x sharding_parallel {par.sharding_parallel})"
        )
    if sharding_stage is not None:
        if sharding_stage not in (1, 2, 3):
            raise UserError(f"DataParallel: sharding_stage must be 1, 2 or 3, got {sharding_stage!r}")
        if sharding_stage != 1:
            raise UserError(
                f"DataParallel: sharding_stage {sharding_stage} wraps the model and optimizer together and is "
                "available through `bmtrain train` (parallel_config.sharding_stage) only; use 1 here"
            )
        if par.sharding_parallel == 1:
            raise UserError(
                "DataParallel(sharding_stage=1) needs init_distributed(sharding_parallel=N) with N > 1"
            )
    for group in ctx.data_groups():
        _broadcast_parameters(model, group)
    return model


# --------------------------------------------------------------------------- tensor parallel


@dataclass(frozen=True)
class Split:
    """How TensorParallel treats one Linear/Embedding layer of the model."""

    name: str
    kind: str  # column | row | vocab | replicate
    paired: bool = (
        False  # column: its output stays split for the row layer after it; row: its input comes split
    )


def _linear_types() -> Tuple[Any, Any]:
    from paddle import nn

    return nn.Linear, nn.Embedding


def _has_parameters(layer: Any) -> bool:
    return any(True for _ in layer.parameters())


def _adjacent_linears(model: Any) -> Iterator[Tuple[str, Any, str, Any]]:
    """(name_a, a, name_b, b) for Linear siblings with only parameter-free layers (activations, dropout)
    registered between them, in registration order: the candidates for a column-then-row pair."""
    linear, _ = _linear_types()
    for prefix, parent in [("", model), *model.named_sublayers()]:
        previous: Optional[Tuple[str, Any]] = None
        for cname, child in parent.named_children():
            full = f"{prefix}.{cname}" if prefix else cname
            if isinstance(child, linear):
                if previous is not None:
                    yield previous[0], previous[1], full, child
                previous = (full, child)
            elif _has_parameters(child):
                previous = None


def _in_out(layer: Any) -> Tuple[int, int]:
    return int(layer.weight.shape[0]), int(layer.weight.shape[1])


def _has_padding_idx(embedding: Any) -> bool:
    return getattr(embedding, "_padding_idx", None) not in (None, -1)


def resolve_plan(model: Any, plan: Optional[Mapping[str, str]], degree: int) -> List[Split]:
    """The Split of every Linear/Embedding in ``model`` under ``plan`` for ``degree`` tensor ranks
    (plain computation, no processes).

    Default: consecutive Linear pairs among a block's children (``out`` of the first = ``in`` of the
    second, only parameter-free layers between, both divisible by ``degree``) become column then row;
    embeddings whose vocabulary divides are split by vocabulary; everything else is replicated. ``plan``
    maps name patterns (fnmatch, e.g. ``"blocks.*.fc1"``; the first matching pattern wins) to a kind and
    overrides the default. A column layer's output stays split only when the next Linear of its block is
    a row layer of matching size; otherwise it is gathered (and a row layer splits its input itself), so
    the outputs always equal the unwrapped model's."""
    linear, embedding = _linear_types()
    layers = {n: layer for n, layer in model.named_sublayers() if isinstance(layer, (linear, embedding))}
    kinds = {n: "replicate" for n in layers}
    for n, layer in layers.items():
        if (
            isinstance(layer, embedding)
            and layer.weight.shape[0] % degree == 0
            and not _has_padding_idx(layer)
        ):
            kinds[n] = "vocab"
    used: set = set()
    for na, a, nb, b in _adjacent_linears(model):
        (_, a_out), (b_in, _) = _in_out(a), _in_out(b)
        if na not in used and a_out == b_in and a_out % degree == 0:
            kinds[na], kinds[nb] = "column", "row"
            used.update((na, nb))
    for pattern, kind in (plan or {}).items():
        if kind not in KINDS:
            raise UserError(
                f"TensorParallel plan: {pattern!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})"
            )
        if not any(fnmatch.fnmatchcase(n, pattern) for n in layers):
            raise UserError(
                f"TensorParallel plan: {pattern!r} matches no Linear/Embedding layer of the model (its layers: "
                f"{', '.join(layers) or 'none'})"
            )
    for n, layer in layers.items():
        kind = next((k for p, k in (plan or {}).items() if fnmatch.fnmatchcase(n, p)), None)
        if kind is None:
            continue
        _check_kind(n, layer, kind, degree)
        kinds[n] = kind
    paired = set()
    for na, a, nb, b in _adjacent_linears(model):
        if kinds[na] == "column" and kinds[nb] == "row" and _in_out(a)[1] == _in_out(b)[0]:
            paired.update((na, nb))
    return [Split(n, kinds[n], n in paired) for n in layers]


def _check_kind(name: str, layer: Any, kind: str, degree: int) -> None:
    linear, embedding = _linear_types()
    if kind == "replicate":
        return
    if isinstance(layer, embedding):
        if kind != "vocab":
            raise UserError(
                f"TensorParallel plan: {name} is an Embedding: 'vocab' or 'replicate', not {kind!r}"
            )
        if _has_padding_idx(layer):
            raise UserError(
                f"TensorParallel plan: {name} has a padding_idx, which a vocabulary split cannot keep"
            )
        size, what = int(layer.weight.shape[0]), "vocabulary"
    else:
        if kind == "vocab":
            raise UserError(
                f"TensorParallel plan: {name} is a Linear: 'column', 'row' or 'replicate', not 'vocab'"
            )
        fan_in, fan_out = _in_out(layer)
        size, what = (fan_out, "output features") if kind == "column" else (fan_in, "input features")
    if size % degree:
        raise UserError(
            f"TensorParallel plan: {name} ({kind}): its {what} ({size}) do not divide by {degree}"
        )


def TensorParallel(  # noqa: N802
    model: Any, split_dim: int = 1, plan: Optional[Mapping[str, str]] = None, degree: Optional[int] = None
) -> Any:
    """Split ``model``'s Linear/Embedding layers over the tensor-parallel ranks (see resolve_plan) by
    replacing them, in place, with fleet's ColumnParallelLinear / RowParallelLinear /
    VocabParallelEmbedding holding this rank's slice of the original weights. ``split_dim=1`` is the
    feature axis (output features of the first layer of a pair, input features of the second), the only
    one supported. ``degree`` (optional) is checked against init_distributed's tensor_parallel. With
    tensor_parallel 1 the model is returned unchanged. Apply before PipelineParallel and build the
    optimizer afterwards."""
    ctx = _context("TensorParallel")
    if split_dim not in (1, -1):
        raise UserError(
            f"TensorParallel: split_dim={split_dim!r}; only 1 (the feature dimension: columns of the first "
            "Linear of a pair, rows of the second) is supported"
        )
    if degree is not None and degree != ctx.tp_degree:
        raise UserError(
            f"TensorParallel(degree={degree}) but init_distributed set up tensor_parallel={ctx.tp_degree}"
        )
    if _spec(model).pipeline is not None:
        raise UserError("TensorParallel: apply it before PipelineParallel (the pipeline holds the layers)")
    if _spec(model).tensor_parallel:
        raise UserError("TensorParallel: the model is already split")
    splits = resolve_plan(model, plan, ctx.tp_degree)
    _spec(model).tensor_parallel = True
    if ctx.tp_degree == 1:
        return model
    group = ctx.hcg.get_model_parallel_group()
    _broadcast_parameters(model, group)
    for split in splits:
        if split.kind == "replicate":
            continue
        parent, attr = _parent(model, split.name)
        parent._sub_layers[attr] = _split_layer(
            parent._sub_layers[attr], split, group, ctx.tp_rank, ctx.tp_degree
        )
    return model


def _parent(model: Any, name: str) -> Tuple[Any, str]:
    *path, attr = name.split(".")
    parent = model
    for part in path:
        parent = parent._sub_layers[part]
    return parent, attr


def _split_layer(old: Any, split: Split, group: Any, rank: int, degree: int) -> Any:
    """The fleet mp layer for ``old`` with this rank's slice of its weights."""
    import paddle
    from paddle.distributed.fleet.meta_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    weight = old.weight
    bias = getattr(old, "bias", None)
    previous_dtype = paddle.get_default_dtype()
    paddle.set_default_dtype(str(weight.dtype).replace("paddle.", ""))
    try:
        if split.kind == "vocab":
            new = VocabParallelEmbedding(int(weight.shape[0]), int(weight.shape[1]), mp_group=group)
        elif split.kind == "column":
            new = ColumnParallelLinear(
                *_in_out(old), has_bias=bias is not None, gather_output=not split.paired, mp_group=group
            )
        else:
            new = RowParallelLinear(
                *_in_out(old), has_bias=bias is not None, input_is_parallel=split.paired, mp_group=group
            )
    finally:
        paddle.set_default_dtype(previous_dtype)
    axis = 1 if split.kind == "column" else 0
    size = int(weight.shape[axis]) // degree
    part = slice(rank * size, (rank + 1) * size)
    with paddle.no_grad():
        new.weight.set_value(weight[:, part] if axis == 1 else weight[part])
        if bias is not None:
            new.bias.set_value(bias[part] if split.kind == "column" else bias)
    new.weight.stop_gradient = weight.stop_gradient
    if bias is not None:
        new.bias.stop_gradient = bias.stop_gradient
    return new


# --------------------------------------------------------------------------- pipeline parallel


def pipeline_items(model: Any) -> List[Any]:
    """The ordered layers of a Sequential / LayerList, or of a model whose parameters all live in one
    LayerList child (its forward is taken to apply them in order)."""
    from paddle import nn

    if isinstance(model, (nn.Sequential, nn.LayerList)):
        return list(model.children())
    lists = [(n, c) for n, c in model.named_children() if isinstance(c, nn.LayerList)]
    outside = [n for n, c in model.named_children() if not isinstance(c, nn.LayerList) and _has_parameters(c)]
    outside += list(model._parameters)
    if len(lists) == 1 and not outside:
        return list(lists[0][1].children())
    found = f"LayerList children {[n for n, _ in lists]}" if lists else "no LayerList child"
    extra = f", parameters outside it: {outside}" if outside else ""
    raise UserError(
        f"PipelineParallel needs a paddle.nn.Sequential, or a model whose parameters all live in one "
        f"paddle.nn.LayerList applied in order; {type(model).__name__} has {found}{extra}"
    )


class _PipelineLoss:
    """The last stage's loss for fleet's train_batch. Fleet divides each micro-batch's loss by the number
    of micro-batches and averages gradients over the data ranks; ``scale`` (set per step by train_step)
    undoes both and weights the micro-batch by its share of the global batch."""

    def __init__(self, loss_fn: Optional[Callable[[Any, Any], Any]]) -> None:
        self.loss_fn = loss_fn
        self.scale = 1.0
        self.row_sums: List[float] = []

    def __call__(self, output: Any, labels: Any) -> Any:
        loss = _scalar_loss(self.loss_fn(output, labels))
        rows = int(labels.shape[0])
        self.row_sums.append(float(loss) * rows)
        return loss * (rows * self.scale)


def PipelineParallel(  # noqa: N802
    model: Any,
    stages: int = 2,
    loss_fn: Optional[Callable[[Any, Any], Any]] = None,
    micro_batches: Optional[int] = None,
    partition: str = "uniform",
    sample_input: Any = None,
) -> Any:
    """Cut ``model`` (a Sequential, or a model whose parameters live in one LayerList) into ``stages``
    pipeline stages (fleet PipelineLayer, 1F1B) and return fleet's pipeline wrapper holding this rank's
    stage. Boundaries by the partitioner of ``bmtrain train``: ``uniform`` (equal numbers of layers with
    parameters), ``parameters`` (balanced parameter counts) or ``measured`` (forward+backward time of
    every layer on ``sample_input``, rank 0's numbers). ``micro_batches`` (default: ``stages``) must divide
    each data rank's batch. ``loss_fn`` may also be given to train_step. With pipeline_parallel 1 the
    model is returned unchanged."""
    ctx = _context("PipelineParallel")
    if stages != ctx.pp_degree:
        raise UserError(
            f"PipelineParallel(stages={stages}) but init_distributed set up pipeline_parallel={ctx.pp_degree}"
        )
    if partition not in PARTITIONS:
        raise UserError(f"PipelineParallel: partition {partition!r} is not one of {', '.join(PARTITIONS)}")
    if partition == "measured" and sample_input is None:
        raise UserError(
            "PipelineParallel(partition='measured') needs sample_input (a batch of the model's input)"
        )
    if micro_batches is not None and (
        isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1
    ):
        raise UserError(f"PipelineParallel: micro_batches must be a positive integer, got {micro_batches!r}")
    if _spec(model).pipeline is not None:
        raise UserError("PipelineParallel: the model is already a pipeline")
    items = pipeline_items(model)
    if len(items) < stages:
        raise UserError(f"PipelineParallel: {len(items)} layer(s) cannot be cut into {stages} stages")
    _spec(model).loss_fn = loss_fn
    if stages == 1:
        return model
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import PipelineLayer

    from bmtrain_cli.parallel import pipeline

    _broadcast_parameters(model, ctx.hcg.get_pipe_parallel_group())
    if partition == "uniform":
        costs = [1.0 if _has_parameters(item) else 0.0 for item in items]
    elif partition == "parameters":
        costs = pipeline.item_parameter_counts(items)
    else:  # every rank measures (tensor-parallel layers talk to their group), rank 0's numbers are used
        box = [pipeline.measure_item_costs(items, _to_tensor(sample_input))]
        dist.broadcast_object_list(box, src=0)
        costs = box[0]
    bounds = pipeline.partition(costs, stages)
    ctx.pipeline_info = {
        "method": partition,
        "boundaries": bounds,
        "stage_costs": pipeline.stage_costs(costs, bounds),
        "imbalance": pipeline.imbalance(costs, bounds),
    }
    loss = _PipelineLoss(loss_fn)
    layer = PipelineLayer(
        layers=items, num_stages=stages, topology=ctx.hcg.topology(), loss_fn=loss, seg_method=bounds
    )
    # fleet's pipeline reads the micro-batch count when it is built (its schedule and hooks are sized by
    # it); the micro-batch size follows each step's batch (train_step)
    fleet.fleet._user_defined_strategy.pipeline_configs = {
        "accumulate_steps": micro_batches or stages,
        "micro_batch_size": 1,
    }
    wrapped = fleet.distributed_model(layer)
    spec = _Spec(tensor_parallel=_spec(model).tensor_parallel, loss_fn=loss_fn, pipeline=loss)
    object.__setattr__(wrapped, _SPEC_ATTR, spec)
    return wrapped


# --------------------------------------------------------------------------- one optimizer step


def _to_tensor(value: Any) -> Any:
    import paddle

    return value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)


def _scalar_loss(loss: Any) -> Any:
    import paddle

    if not isinstance(loss, paddle.Tensor) or int(loss.size) != 1:
        raise UserError("train_step: loss_fn must return a one-element Tensor (the mean over the batch rows)")
    return loss.reshape([])


def _optimizer_for(ctx: ParallelContext, model: Any, optimizer: Any) -> Any:
    """The optimizer wrapper that reduces gradients for this layout (built once per optimizer)."""
    wrapped = getattr(optimizer, _WRAPPED_ATTR, None)
    if wrapped is not None:
        return wrapped
    if not hasattr(optimizer, "_parameter_list"):
        raise UserError("train_step: optimizer must be a paddle.optimizer.Optimizer")
    mine = {id(p) for p in optimizer._parameter_list or []}
    missing = [n for n, p in model.named_parameters() if not p.stop_gradient and id(p) not in mine]
    if missing:
        raise UserError(
            f"train_step: the optimizer does not hold the model's parameters ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); build it after the wrappers, over model.parameters()"
        )
    from paddle.nn import ClipGradByNorm

    if ctx.tp_degree > 1 and isinstance(getattr(optimizer, "_grad_clip", None), ClipGradByNorm):
        raise UserError(
            "train_step: ClipGradByNorm clips each tensor by its own norm, which under tensor parallel is a "
            "shard's norm; use paddle.nn.ClipGradByGlobalNorm (exact under every layout)"
        )
    wrapped = ctx.wrap_optimizer(optimizer)
    setattr(optimizer, _WRAPPED_ATTR, wrapped)
    return wrapped


def train_step(
    model: Any, batch: Tuple[Any, Any], loss_fn: Optional[Callable[[Any, Any], Any]], optimizer: Any
) -> float:
    """One optimizer step: forward, backward, gradient reduction over the data ranks, the optimizer's
    clip (if it has a grad_clip) and update; gradients are cleared afterwards.

    ``batch = (inputs, labels)`` is this data rank's slice of the global batch (the tensor and pipeline
    ranks of one data rank pass the same slice); ``model(inputs)`` is the output. ``loss_fn(output,
    labels)`` returns the mean over the rows of ``labels``. Returns the mean loss over the whole global
    batch, the same number on every rank."""
    ctx = _context("train_step")
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise UserError("train_step: batch must be (inputs, labels)")
    spec = getattr(model, _SPEC_ATTR, None) or _Spec()
    if ctx.pp_degree > 1 and spec.pipeline is None:
        raise UserError(
            f"train_step: init_distributed set up pipeline_parallel={ctx.pp_degree}; wrap the model with "
            f"PipelineParallel(model, stages={ctx.pp_degree})"
        )
    if ctx.tp_degree > 1 and not spec.tensor_parallel:
        raise UserError(
            f"train_step: init_distributed set up tensor_parallel={ctx.tp_degree}; wrap the model with "
            "TensorParallel(model) before building the optimizer"
        )
    loss_fn = loss_fn or spec.loss_fn
    if loss_fn is None:
        raise UserError("train_step: no loss_fn (pass one here or to PipelineParallel)")
    inputs, labels = (_to_tensor(x) for x in batch)
    rows = int(labels.shape[0])
    total_rows = ctx.all_reduce_sum(float(rows))
    wrapped = _optimizer_for(ctx, model, optimizer)
    ctx.mark_progress()
    if spec.pipeline is not None:
        return _pipeline_step(ctx, model, spec.pipeline, inputs, labels, loss_fn, wrapped, total_rows)
    loss = _scalar_loss(loss_fn(model(inputs), labels))
    (loss * (rows / total_rows)).backward()
    wrapped.step()
    wrapped.clear_grad()
    return ctx.all_reduce_sum(float(loss) * rows) / total_rows


def _pipeline_step(
    ctx: ParallelContext,
    model: Any,
    hook: _PipelineLoss,
    inputs: Any,
    labels: Any,
    loss_fn: Optional[Callable[[Any, Any], Any]],
    wrapped: Any,
    total_rows: float,
) -> float:
    from bmtrain_cli.parallel.pipeline import from_last_stage
    from bmtrain_cli.parallel.sharding import GradSumOptimizer

    rows, micro = int(labels.shape[0]), int(model.accumulate_steps)
    if rows % micro:
        raise UserError(
            f"train_step: this data rank's batch of {rows} rows does not split into {micro} pipeline "
            "micro-batches (PipelineParallel's micro_batches)"
        )
    model.micro_batch_size = rows // micro
    hook.loss_fn, hook.row_sums = loss_fn, []
    hook.scale = micro * ctx.data_world / total_rows
    inputs.stop_gradient = True
    # train_batch wants fleet's own optimizer; the data-rank averaging is undone by ``scale`` instead
    inner = wrapped._inner if isinstance(wrapped, GradSumOptimizer) else wrapped
    model.train_batch([inputs, labels], inner)
    local = sum(hook.row_sums)
    return ctx.all_reduce_sum(from_last_stage(ctx, local)) / total_rows
