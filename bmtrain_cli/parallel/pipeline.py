"""Pipeline parallel: the decoder as a fleet PipelineLayer, stage boundaries, and a 1F1B training step.

The built CausalLM is cut into a list of pipeline items: the embedding, one item per decoder layer and
the head (final norm + LM head). Between stages travels the tuple (hidden, attention_mask, position_ids)
(and a mixture of experts' load-balancing sums, parallel/pipeline_moe.py); each stage recomputes the
rotary tables and the attention bias from the masks, so no float masks are sent. Partition methods
(parallel_config.pipeline_partition): ``uniform``, the same number of decoder layers per stage;
``parameters``, balance parameter counts (the embedding and head weigh in); ``measured``, time
forward+backward of every item on a sample batch (rank 0 measures, everyone uses its numbers) and balance
the measured cost. The cut minimises the most expensive stage; the imbalance (max stage cost / mean) is
reported. Training uses fleet's PipelineParallel.train_batch (1F1B) with the trainer's micro-batches."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.parallel.full_weights import NAME_MAP_ATTR, QUANT_NAME_MAP_ATTR, quantized_names
from bmtrain_cli.parallel.protocol import ParallelCtx, Topology

# --------------------------------------------------------------------------- partition (plain maths)


def partition(costs: Sequence[float], stages: int) -> List[int]:
    """Boundaries [0, b1, ..., len(costs)] of ``stages`` contiguous non-empty parts minimising the
    largest part's cost (exact dynamic programme; n and stages are small)."""
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot cut {n} items into {stages} stages")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    inf = float("inf")
    best = np.full((stages + 1, n + 1), inf)
    cut = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1, i], prefix[j] - prefix[i])
                if value < best[k, j] - 1e-12:
                    best[k, j], cut[k, j] = value, i
    bounds = [n]
    j = n
    for k in range(stages, 0, -1):
        j = int(cut[k, j])
        bounds.append(j)
    return bounds[::-1]


def stage_costs(costs: Sequence[float], bounds: Sequence[int]) -> List[float]:
    return [float(sum(costs[bounds[i] : bounds[i + 1]])) for i in range(len(bounds) - 1)]


def imbalance(costs: Sequence[float], bounds: Sequence[int]) -> float:
    """Most expensive stage / mean stage cost (1.0 = perfectly balanced)."""
    per = stage_costs(costs, bounds)
    mean = sum(per) / len(per)
    return max(per) / mean if mean > 0 else 1.0


def uniform_costs(num_layers: int) -> List[float]:
    """Embedding, final norm and head cost nothing, every decoder layer 1: equal layer counts."""
    return [0.0] + [1.0] * num_layers + [0.0, 0.0]


# --------------------------------------------------------------------------- pipeline items


TIED_KEY = "tied_embedding"  # SharedLayerDesc key of the tied input/output embedding


@dataclasses.dataclass(frozen=True)
class PipelineItems:
    """The model as a sequence of pipeline items: ``layers`` (plain layers, for the partition's costs)
    and ``descs`` (what fleet's PipelineLayer is built from; the same layers when nothing is shared);
    ``names`` maps id(parameter) to its single-process name."""

    layers: List[Any]
    descs: List[Any]
    names: Dict[int, str]

    @property
    def decoder_layers(self) -> int:
        return len(self.layers) - 3  # embedding, final norm, head


def _build_items(model: Any) -> PipelineItems:
    """Pipeline items: embedding, one per decoder layer, final norm, head. With tied embeddings the
    first and the last item are one SharedLayerDesc: fleet keeps the weight on both stages, broadcasts it
    from the first at start, sums its two gradients after every backward (allreduce_shared_weight_
    gradients) and counts it once in the clip's norm (``is_firstly_shared``)."""
    from paddle import nn
    from paddle.distributed.fleet.meta_parallel import SharedLayerDesc

    from bmtrain_cli.models.attention import ContextShard
    from bmtrain_cli.models.decoder import embed, project_to_vocab
    from bmtrain_cli.parallel.pipeline_moe import add_layer_sums, join_sums, split_sums, start_sums

    arch = model.arch
    factory = model.factory
    layer_inputs = model.layer_inputs  # the single-process model's own (rotary tables, attention bias)

    class EmbedStage(nn.Layer):
        def __init__(self, embed_tokens: Any) -> None:
            super().__init__()
            self.embed_tokens = embed_tokens

        @property
        def weight(self) -> Any:  # the attribute SharedLayerDesc shares
            return self.embed_tokens.weight

        def forward(self, args: Any) -> Any:
            input_ids, mask, pos = args
            mask.stop_gradient = True
            pos.stop_gradient = True
            return (embed(arch, self.embed_tokens, input_ids), mask, pos, *start_sums(arch))

    class DecoderStage(nn.Layer):
        def __init__(self, layer: Any, recompute: bool) -> None:
            super().__init__()
            self.layer = layer
            self.recompute = recompute

        def forward(self, args: Any) -> Any:
            x, mask, pos, *sums = args  # sums: a mixture of experts' (parallel/pipeline_moe.py)
            kind = self.layer.layer_type
            # context parallel: x is a share of each row, mask the rows' ids (copied: fleet frees sent outputs)
            core = getattr(model, "context_attention", None)
            held = mask if core is None else ContextShard(core, mask.clone())
            cos, sin, bias = layer_inputs(held, pos, x.shape[1], 0, x.dtype, (kind,))[kind]
            if self.recompute and self.training:
                from paddle.distributed.fleet.utils import recompute

                x = recompute(self.layer, x, cos, sin, bias)
            else:
                x = self.layer(x, cos, sin, bias)
            return (x, mask, pos, *add_layer_sums(self.layer, mask, sums, core))

    class NormStage(nn.Layer):
        def __init__(self, norm: Any) -> None:
            super().__init__()
            self.norm = norm

        def forward(self, args: Any) -> Any:
            x, rest = split_sums(args)
            return join_sums(self.norm(x), rest[2:])

    class HeadStage(nn.Layer):
        def __init__(self, lm_head: Any) -> None:
            super().__init__()
            self.lm_head = lm_head

        def forward(self, hidden: Any) -> Any:
            hidden, sums = split_sums(hidden)
            return join_sums(project_to_vocab(hidden, arch, factory, self.lm_head, None), sums)

    class TiedHeadStage(EmbedStage):
        """The head over the tied embedding's weight (the last stage's copy of the shared layer)."""

        def forward(self, hidden: Any) -> Any:
            hidden, sums = split_sums(hidden)
            return join_sums(project_to_vocab(hidden, arch, factory, None, self.weight), sums)

    recompute_layers: Set[int] = getattr(model, "_recompute_layers", set())
    embed_tokens = model.model.embed_tokens
    body: List[nn.Layer] = [
        DecoderStage(layer, i in recompute_layers) for i, layer in enumerate(model.model.layers)
    ]
    body.append(NormStage(model.model.norm))
    names = {id(p): n for n, p in model.named_parameters()}
    if model.lm_head is not None:
        layers = [EmbedStage(embed_tokens), *body, HeadStage(model.lm_head)]
        return PipelineItems(layers, layers, names)
    # one key, two layer classes: each stage builds the shared layer from the desc it holds (the first
    # and the last stage are different ranks for pp > 1), both over the same embedding weight
    descs = [
        SharedLayerDesc(TIED_KEY, EmbedStage, None, "weight", embed_tokens),
        *body,
        SharedLayerDesc(TIED_KEY, TiedHeadStage, None, "weight", embed_tokens),
    ]
    return PipelineItems([EmbedStage(embed_tokens), *body, TiedHeadStage(embed_tokens)], descs, names)


def item_parameter_counts(items: Sequence[Any]) -> List[float]:
    return [float(sum(int(np.prod(p.shape)) for p in it.parameters())) for it in items]


def decoder_sample(batch: int, seq: int, vocab: int) -> Tuple[Any, Any, Any]:
    """A random (input_ids, attention_mask, position_ids) batch: the decoder's first pipeline input."""
    import paddle

    ids = paddle.randint(0, vocab, [batch, seq])
    mask = paddle.ones([batch, seq], dtype="int64")
    pos = paddle.arange(seq, dtype="int64").unsqueeze(0).expand([batch, seq])
    return ids, mask, pos


def measure_item_costs(items: Sequence[Any], x: Any, steps: int = 3) -> List[float]:
    """Seconds of forward+backward per item, ``x`` being the first item's input (median of ``steps``
    after one warm-up). Items after the first get the previous item's output, a tensor or a tuple whose
    first element is the hidden state."""
    costs = []
    for item in items:
        times = []
        out: Any = None
        for i in range(steps + 1):
            if item is items[0]:
                args: Any = x
            else:  # a fresh leaf for the hidden state: time this item's backward only
                hidden = (x[0] if isinstance(x, tuple) else x).detach()
                hidden.stop_gradient = False
                args = (hidden, x[1], x[2]) if isinstance(x, tuple) else hidden
            t0 = time.perf_counter()
            out = item(args)
            first = out[0] if isinstance(out, tuple) else out
            first.mean().backward()
            if i:
                times.append(time.perf_counter() - t0)
        for p in item.parameters():
            p.clear_gradient()
        costs.append(float(np.median(times)))
        x = out
    return costs


def item_parameter_names(model: Any) -> List[List[str]]:
    """The single-process names of each pipeline item's parameters (the tied embedding in the first and last)."""
    items = _build_items(model)
    return [[items.names[id(p)] for p in layer.parameters()] for layer in items.layers]


def stage_layers(bounds: Sequence[int], decoder_layers: int) -> List[List[int]]:
    """The decoder layer indices of each stage cut at ``bounds`` (item i > 0 is decoder layer i - 1)."""
    return [
        [i - 1 for i in range(bounds[s], bounds[s + 1]) if 0 < i <= decoder_layers]
        for s in range(len(bounds) - 1)
    ]


def measured_costs(items: Sequence[Any], sample: Any) -> List[float]:
    """``measured`` partition costs: every rank times the items (tp layers talk), rank 0's are used."""
    import paddle.distributed as dist

    box = [measure_item_costs(items, sample)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def cut_into_stages(
    descs: Sequence[Any],
    costs: Sequence[float],
    ctx: ParallelCtx,
    loss_fn: Any,
    method: str,
    bounds: Optional[Sequence[int]] = None,
) -> Any:
    """The one place a model becomes pipeline stages, for `bmtrain train` and the API's PipelineParallel:
    boundaries by ``partition(costs)`` (or ``bounds``), recorded in ``ctx.pipeline_info``, and fleet's
    PipelineLayer holding this rank's stage."""
    from paddle.distributed.fleet.meta_parallel import PipelineLayer

    bounds = [int(b) for b in bounds] if bounds is not None else partition(costs, ctx.pp_degree)
    ctx.pipeline_info = {
        "method": method,
        "boundaries": bounds,
        "stage_costs": stage_costs(costs, bounds),
        "imbalance": imbalance(costs, bounds),
    }
    return PipelineLayer(
        layers=list(descs),
        num_stages=ctx.pp_degree,
        topology=ctx.hcg.topology(),
        loss_fn=loss_fn,
        seg_method=bounds,
    )


def to_pipeline_layer(
    model: Any,
    ctx: ParallelCtx,
    costs: Optional[Sequence[float]] = None,
    bounds: Optional[Sequence[int]] = None,
) -> Any:
    """Cut a built CausalLM into this rank's pipeline stage (fleet PipelineLayer). ``costs`` (one per
    item, the same on every rank): cut by them instead of by pipeline_partition (a rebalance);
    ``bounds``: cut there (a resume continuing a rebalanced cut; ignored unless it fits this model)."""
    config = ctx.config
    method: str = config.parallel.pipeline_partition if config is not None else "uniform"
    items = _build_items(model)
    layers = items.decoder_layers
    if costs is not None:
        method = "rebalanced"
        costs = list(costs)
    elif method == "uniform":
        costs = uniform_costs(layers)
    elif method == "parameters":
        costs = item_parameter_counts(items.layers)
    else:
        seq = min(128, config.model.max_seq_len if config is not None else 128)
        vocab = model.arch.vocab_size // ctx.tp_degree * ctx.tp_degree
        costs = measured_costs(items.layers, decoder_sample(1, seq, vocab))
    if bounds is not None and len(bounds) == ctx.pp_degree + 1 and bounds[-1] == len(items.layers):
        method = f"{method}, the checkpoint's cut"
    else:
        bounds = None
    loss_fn = _PipelineLoss(ctx, model.arch)
    pipe = cut_into_stages(items.descs, costs, ctx, loss_fn, method, bounds)
    info = ctx.pipeline_info
    info["stage_layers"] = stage_layers(info["boundaries"], layers)
    if ctx.rank == 0:
        print(
            f"pipeline partition ({method}): decoder layers per stage {info['stage_layers']}, "
            f"stage costs {[round(c, 4) for c in info['stage_costs']]}, imbalance {info['imbalance']:.3f} "
            "(max stage / mean)",
            flush=True,
        )
    _mark_shared_copies(pipe)
    object.__setattr__(pipe, "_bmtrain_loss", loss_fn)
    full_names = {n: items.names[id(p)] for n, p in pipe.named_parameters() if id(p) in items.names}
    object.__setattr__(pipe, NAME_MAP_ATTR, full_names)
    object.__setattr__(pipe, QUANT_NAME_MAP_ATTR, quantized_names(model))  # a quantised base's layers
    object.__setattr__(pipe, "arch", model.arch)
    return pipe


def _mark_shared_copies(pipe: Any) -> None:
    """Mark the copies of a shared weight on every stage but the first ``is_firstly_shared = False``, so
    fleet's clip counts the weight once. PipelineLayer means to do it, but compares the parameters'
    unique names (``embedding_0.w_0``) with the attribute names (``weight``), which never match."""
    for comm in pipe.shared_comm.values():
        if pipe.global_rank == min(comm["ranks"]):
            continue
        for attr in comm["weight_attr"]:
            getattr(comm["layer"], attr).is_firstly_shared = False


class PipelineObjective(Protocol):
    """A loss other than the token cross entropy, computed on the last stage from (logits, labels):
    ``pipeline_data`` gives fleet's per-micro-batch inputs (a tuple of three lists: input_ids,
    attention_mask, position_ids) and labels, with the step's denominator summed over the data ranks;
    ``loss_sum`` (one micro-batch's summed loss from its logits and labels, its load-balancing loss's weight)."""

    def pipeline_data(
        self, micro_batches: Sequence[Dict[str, Any]], length: int
    ) -> Tuple[Any, Any, float]: ...

    def loss_sum(self, logits: Any, labels: Any) -> Tuple[Any, Any]: ...


class _PipelineLoss:
    """Weighted loss for train_batch: fleet divides each micro-batch loss by the number of micro-batches,
    so return loss_sum x micro_batches / (the step's denominator over all data ranks): its tokens for the
    token loss, the objective's (e.g. pairs) when one is set for the step."""

    def __init__(self, ctx: ParallelCtx, arch: Any = None) -> None:
        self.ctx, self.arch = ctx, arch
        self.scale = 1.0
        self.sums: List[Any] = []
        self.auxes: List[Any] = []  # a mixture of experts' load-balancing losses of the step (logged)
        self.objective: Optional[PipelineObjective] = None

    def __call__(self, logits: Any, target: Any) -> Any:
        from bmtrain_cli.parallel.pipeline_moe import split_sums, with_aux

        logits, sums = split_sums(logits)  # a mixture of experts' load-balancing sums
        if self.objective is not None:
            loss_sum, count = self.objective.loss_sum(logits, target)
        else:
            flat, labels = logits.reshape([-1, logits.shape[-1]]), target.reshape([-1])
            if self.ctx.wrapping.factory.tp_degree > 1:
                loss_sum, count = self.ctx.wrapping.factory.vocab_cross_entropy_sum(flat, labels)
            else:
                from bmtrain_cli.ops import reference

                loss_sum, count = reference.cross_entropy_sum(flat, labels)
        loss_sum = with_aux(loss_sum, count, sums, self.arch, self.auxes, self.ctx.context_ring)
        self.sums.append(loss_sum.detach())
        return loss_sum * self.scale


def shifted_targets(labels: np.ndarray, mask: Optional[np.ndarray]) -> np.ndarray:
    """Per-position targets: position t predicts labels[t+1] within the same segment, else ignored."""
    target = np.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    if mask is not None:
        same = mask[:, 1:] == mask[:, :-1]
        target[:, :-1] = np.where(same, target[:, :-1], IGNORE_INDEX)
    return target


def _pad_to(arr: np.ndarray, length: int, value: int) -> np.ndarray:
    if arr.shape[1] == length:
        return arr
    pad = np.full((arr.shape[0], length - arr.shape[1]), value, dtype=arr.dtype)
    return np.concatenate([arr, pad], axis=1)


def stack_micro_batches(
    micro_batches: Sequence[Dict[str, Any]], length: Optional[int] = None
) -> Dict[str, np.ndarray]:
    """Concatenate micro-batches padded to one length (``length``, or the longest) and compute the
    shifted targets. Fleet's pipeline fixes the shapes sent between stages at the first step, so
    training pads every step to the same length (max_seq_len)."""
    arrays = [
        {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in mb.items()}
        for mb in micro_batches
    ]
    length = max([length or 0] + [a["input_ids"].shape[1] for a in arrays])
    out: Dict[str, List[np.ndarray]] = {
        k: [] for k in ("input_ids", "attention_mask", "position_ids", "target")
    }
    for a in arrays:
        s = a["input_ids"].shape[1]
        mask = a.get("attention_mask")
        if mask is None:
            mask = np.ones_like(a["input_ids"])
        pos = a.get("position_ids")
        if pos is None:
            pos = np.broadcast_to(np.arange(s), a["input_ids"].shape).copy()
        out["input_ids"].append(_pad_to(a["input_ids"], length, 0))
        out["attention_mask"].append(_pad_to(mask, length, 0))
        out["position_ids"].append(_pad_to(pos, length, 0))
        out["target"].append(_pad_to(shifted_targets(a["labels"], mask), length, IGNORE_INDEX))
    return {k: np.concatenate(v, axis=0).astype(np.int64) for k, v in out.items()}


def _token_data(
    ctx: ParallelCtx, micro_batches: Sequence[Dict[str, Any]], length: Optional[int]
) -> Tuple[Any, Any, float]:
    """(inputs, shifted targets, the step's target tokens over the data ranks) of the token loss."""
    import paddle

    data = stack_micro_batches(micro_batches, length)
    ring = ctx.context_ring
    if ring is not None:  # this rank's share of each row (targets shifted before); the mask stays whole
        from bmtrain_cli.parallel.ring_attention import local_indices

        idx = local_indices(data["input_ids"].shape[1], ring.degree, ring.rank)
        data = {k: v if k == "attention_mask" else v[:, idx] for k, v in data.items()}
    count = ctx.collectives.all_reduce_sum(float((data["target"] != IGNORE_INDEX).sum()))
    if count <= 0:
        raise UserError("a training step has no target tokens (all labels are -100)")
    inputs = tuple(paddle.to_tensor(data[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    return inputs, paddle.to_tensor(data["target"]), count


def pipeline_train_step(
    ctx: ParallelCtx,
    model: Any,
    micro_batches: Sequence[Dict[str, Any]],
    optimizer: Any,
    lr_scheduler: Any = None,
    objective: Optional[PipelineObjective] = None,
    scaler: Any = None,
) -> Tuple[float, float]:
    """Forward+backward of all micro-batches (1F1B) and one optimizer step (the token loss, or
    ``objective``'s; ``scaler``: the fp16 loss scaler). Returns (loss_sum, denominator) summed over micro-batches and data ranks, on every rank."""
    ctx.collectives.mark_progress()
    length = ctx.config.model.max_seq_len if ctx.config is not None else None
    if objective is None:
        inputs, target, count = _token_data(ctx, micro_batches, length)
    else:
        inputs, target, count = objective.pipeline_data(micro_batches, length or 0)
    inner = model._layers if hasattr(model, "_layers") else model
    loss_fn: _PipelineLoss = inner._bmtrain_loss
    loss_fn.sums, loss_fn.auxes, loss_fn.objective = [], [], objective
    accumulate = getattr(model, "accumulate_steps", len(micro_batches))
    # fleet averages gradients over the data ranks: scale by their number so the result is the sum
    loss_fn.scale = accumulate * ctx.data_world / max(count, 1.0)
    from bmtrain_cli.parallel.sharding import GradSumOptimizer

    if isinstance(optimizer, GradSumOptimizer):
        optimizer = optimizer._inner  # train_batch insists on fleet's own optimizer class
    # fp16: train_batch scales each micro-batch's loss and steps through scaler.step/update (the scaler
    # is fleet.distributed_scaler's, so found_inf is decided over all ranks)
    model.train_batch([inputs, target], optimizer, lr_scheduler, scaler=scaler)
    local = float(sum(float(s) for s in loss_fn.sums)) if loss_fn.sums else 0.0
    total = ctx.collectives.all_reduce_sum(from_last_stage(ctx, local))
    ctx.collectives.mark_progress()
    return total, count


def last_stage_values(ctx: Topology, values: np.ndarray) -> np.ndarray:
    """The last pipeline stage's float64 ``values`` (where the loss is computed), on every stage."""
    import paddle
    import paddle.distributed as dist

    t = paddle.to_tensor(np.asarray(values, dtype=np.float64).reshape([-1]))
    pp_group = ctx.hcg.get_pipe_parallel_group()
    dist.broadcast(t, src=pp_group.ranks[-1], group=pp_group)
    return np.asarray(t.numpy(), dtype=np.float64)


def from_last_stage(ctx: ParallelCtx, value: float) -> float:
    """The last pipeline stage's ``value`` (where the loss is computed), on every stage."""
    return float(last_stage_values(ctx, np.asarray([value]))[0])
