"""TensorParallel: paddle.nn.Linear / Embedding layers replaced by fleet's column / row / vocab parallel
layers holding slices of the original weights, by a plan (resolve_plan) or the model's adjacent linears."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Optional, Set, Tuple

from bmtrain_cli.api.common import broadcast_parameters, has_parameters, linear_types, spec_of
from bmtrain_cli.api.distributed import context
from bmtrain_cli.errors import UserError

KINDS = ("column", "row", "vocab", "replicate")


@dataclass(frozen=True)
class Split:
    """How TensorParallel treats one Linear/Embedding layer of the model."""

    name: str
    kind: str  # column | row | vocab | replicate
    paired: bool = (
        False  # column: its output stays split for the row layer after it; row: its input comes split
    )


def _adjacent_linears(model: Any) -> Iterator[Tuple[str, Any, str, Any]]:
    """(name_a, a, name_b, b) for Linear siblings with only parameter-free layers (activations, dropout)
    registered between them, in registration order: the candidates for a column-then-row pair."""
    linear, _ = linear_types()
    for prefix, parent in [("", model), *model.named_sublayers()]:
        previous: Optional[Tuple[str, Any]] = None
        for cname, child in parent.named_children():
            full = f"{prefix}.{cname}" if prefix else cname
            if isinstance(child, linear):
                if previous is not None:
                    yield previous[0], previous[1], full, child
                previous = (full, child)
            elif has_parameters(child):
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
    linear, embedding = linear_types()
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
        picked = next((k for p, k in (plan or {}).items() if fnmatch.fnmatchcase(n, p)), None)
        if picked is None:
            continue
        _check_kind(n, layer, picked, degree)
        kinds[n] = picked
    paired: Set[str] = set()
    for na, a, nb, b in _adjacent_linears(model):
        if kinds[na] == "column" and kinds[nb] == "row" and _in_out(a)[1] == _in_out(b)[0]:
            paired.update((na, nb))
    return [Split(n, kinds[n], n in paired) for n in layers]


def _check_kind(name: str, layer: Any, kind: str, degree: int) -> None:
    linear, embedding = linear_types()
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


def TensorParallel(
    model: Any, split_dim: int = 1, plan: Optional[Mapping[str, str]] = None, degree: Optional[int] = None
) -> Any:
    """Split ``model``'s Linear/Embedding layers over the tensor-parallel ranks (see resolve_plan) by
    replacing them, in place, with fleet's ColumnParallelLinear / RowParallelLinear /
    VocabParallelEmbedding holding this rank's slice of the original weights. ``split_dim=1`` is the
    feature axis (output features of the first layer of a pair, input features of the second), the only
    one supported. ``degree`` (optional) is checked against init_distributed's tensor_parallel. With
    tensor_parallel 1 the model is returned unchanged. Apply before PipelineParallel and build the
    optimizer afterwards."""
    ctx = context("TensorParallel")
    if split_dim not in (1, -1):
        raise UserError(
            f"TensorParallel: split_dim={split_dim!r}; only 1 (the feature dimension: columns of the first "
            "Linear of a pair, rows of the second) is supported"
        )
    if degree is not None and degree != ctx.tp_degree:
        raise UserError(
            f"TensorParallel(degree={degree}) but init_distributed set up tensor_parallel={ctx.tp_degree}"
        )
    if spec_of(model).pipeline is not None:
        raise UserError("TensorParallel: apply it before PipelineParallel (the pipeline holds the layers)")
    if spec_of(model).tensor_parallel:
        raise UserError("TensorParallel: the model is already split")
    splits = resolve_plan(model, plan, ctx.tp_degree)
    spec_of(model).tensor_parallel = True
    if ctx.tp_degree == 1:
        return model
    group = ctx.hcg.get_model_parallel_group()
    broadcast_parameters(model, group)
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
    new: paddle.nn.Layer
    previous_dtype = paddle.get_default_dtype()
    paddle.set_default_dtype(str(weight.dtype).replace("paddle.", ""))  # type: ignore[arg-type]  # a dtype name
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
