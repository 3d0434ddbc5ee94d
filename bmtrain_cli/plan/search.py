"""Layout search: enumerate (dp, tp, pp, sharding stage, context parallel, expert parallel, recompute, micro
batch, offload) for a number of devices, keep the layouts the config admits (``admits``: validate-config's
checks, config/layout_admission.py) that fit, and rank them by an estimated step time; and the longest
sequence a layout fits (:func:`longest_sequence`).

Step time = compute (model FLOPs / (device peak x efficiency)), plus the pipeline bubble, plus the
communication that does not overlap: the data-parallel gradient all-reduce (or the sharded
reduce-scatter + all-gather), tensor-parallel all-reduces of every layer, pipeline sends, the context
group's ring exchanges of K/V (and their gradients) in every layer, the expert group's all-to-alls of the
routed rows in every sparse layer, and host copies when offloading. A mixture of experts computes with its
active parameters (the top-k experts a token passes). Bandwidth is the intra-node link when a group fits in a node, else the
inter-node one. It is a ranking model, not a stopwatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from bmtrain_cli.models.moe import tensor_parallel_problem
from bmtrain_cli.models.param_count import count_parameters, sparse_layers
from bmtrain_cli.plan.activations import lora_layer_params
from bmtrain_cli.plan.devices import Device
from bmtrain_cli.plan.estimator import estimate_layout
from bmtrain_cli.plan.workload import Layout, MemoryEstimate, Workload

MATMUL_EFFICIENCY = 0.5  # sustained fraction of the dense peak in a transformer step
TP_EFFICIENCY_LOSS = 0.04  # per doubling of tensor parallel (smaller matrices)


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step_time_s: float
    breakdown: Dict[str, float]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "layout": self.layout.__dict__.copy(),
            "step_time_s": self.step_time_s,
            "breakdown": self.breakdown,
            "peak_bytes": self.memory.peak,
            "required_bytes": self.memory.required,
            "fits": self.memory.fits,
        }


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def model_flops_per_token(w: Workload, recompute: str) -> float:
    """Training FLOPs per token (forward + backward, plus the recomputed forward)."""
    a = w.arch
    # every weight but the input embedding (a lookup) is a matmul; a tied matrix counts once, as the head;
    # a sparse layer runs its router and the top-k experts of each token
    n_matmul = count_parameters(a, active=True) - (
        0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size
    )
    attn = 2 * w.seq_len * a.num_attention_heads * a.head_dim * a.num_hidden_layers  # causal: half of 4 s q
    fwd = 2 * n_matmul + attn
    if w.finetuning == "lora":
        total = (
            3 * fwd
            - 2 * (n_matmul - a.vocab_size * a.hidden_size)
            + 6 * a.num_hidden_layers * lora_layer_params(w, 1)
        )
    else:
        total = 3 * fwd
    if recompute == "full":
        total += fwd - 2 * a.vocab_size * a.hidden_size
    elif recompute == "attention":
        total += attn
    return float(total)


def step_time(w: Workload, layout: Layout, device: Device, nodes: int = 1) -> Dict[str, float]:
    """Estimated seconds per optimizer step, by part."""
    a = w.arch
    world = layout.world_size
    tokens = w.global_batch * w.seq_len
    low = w.precision in ("bf16", "fp16")
    peak = device.peak_flops if low else device.peak_flops_fp32
    eff = MATMUL_EFFICIENCY * (1 - TP_EFFICIENCY_LOSS * (layout.tp.bit_length() - 1))
    small = layout.micro_batch * w.seq_len // layout.cp
    eff *= min(1.0, 0.75 + 0.25 * small / 4096)
    compute = model_flops_per_token(w, layout.recompute) * tokens / world / (peak * eff)

    per_node = device.gpus_per_node
    e = 2 if low else 4
    pbytes = 2 if low and w.amp_level == "O2" else 4
    micro_per_rank = max(1, w.global_batch // (layout.micro_batch * layout.data_ranks))

    # pipeline bubble (1F1B): (pp - 1) idle slots out of (m + pp - 1)
    bubble = 0.0
    if layout.pp > 1:
        m = layout.pipeline_micro_batches or micro_per_rank
        bubble = compute * (layout.pp - 1) / m

    def bw(group: int, inner: int) -> float:
        return device.intra_node_bw if group * inner <= per_node and nodes >= 1 else device.inter_node_bw

    # tensor parallel: 2 all-reduces forward, 2 backward (+2 recomputed) per layer and micro-batch
    tp_comm = 0.0
    if layout.tp > 1:
        msg = layout.micro_batch * w.seq_len * a.hidden_size * e
        per_layer = 4 + (2 if layout.recompute == "full" else 0)
        ring = 2 * (layout.tp - 1) / layout.tp
        layers_per_stage = -(-a.num_hidden_layers // layout.pp)
        tp_comm = micro_per_rank * layers_per_stage * per_layer * ring * msg / bw(layout.tp, 1)

    # data parallel / sharding: gradient all-reduce (reduce-scatter + all-gather) once per step
    dp_comm = 0.0
    if layout.data_ranks > 1:
        # bucketed all-reduce overlaps with the backward of earlier layers: half of it shows
        dp_comm = (
            0.5 * _data_parallel_bytes(w, layout, pbytes, micro_per_rank) / bw(layout.data_ranks, layout.tp)
        )

    pp_comm = 0.0
    if layout.pp > 1:
        msg = layout.micro_batch * w.seq_len * a.hidden_size * e
        pp_comm = 2 * micro_per_rank * msg / bw(layout.pp, layout.tp * layout.data_ranks)

    cp_comm = micro_per_rank * _ring_bytes(w, layout, e) / bw(layout.cp, layout.tp) if layout.cp > 1 else 0.0
    ep_comm = 0.0
    if layout.ep > 1:
        ep_comm = micro_per_rank * _all_to_all_bytes(w, layout, e) / bw(layout.ep, layout.tp * layout.cp)
    offload = 0.0
    if layout.offload_optimizer or layout.offload_params:
        n: float = (
            (a.num_hidden_layers * lora_layer_params(w, 1)) if w.finetuning == "lora" else count_parameters(a)
        )
        n /= layout.tp * layout.pp * (layout.sharding if layout.sharding > 1 else 1)
        offload = n * (pbytes * 2) / device.host_bw + n * 16 * 2 / device.host_update_bw
        if layout.offload_params:
            offload += (
                micro_per_rank * 2 * count_parameters(a) * pbytes / (layout.tp * layout.pp) / device.host_bw
            )
    parts = {
        "compute": compute,
        "pipeline_bubble": bubble,
        "tensor_parallel_comm": tp_comm,
        "data_parallel_comm": dp_comm,
        "pipeline_comm": pp_comm,
        "context_parallel_comm": cp_comm,
        "expert_parallel_comm": ep_comm,
        "offload": offload,
    }
    parts["total"] = sum(parts.values())
    return parts


def _ring_bytes(w: Workload, layout: Layout, e: int) -> float:
    """Bytes one rank of a context group sends per micro-batch (parallel/ring_attention.py, blocking
    send/recv, so none of it overlaps): each layer's forward passes this rank's K/V on cp - 1 times, its
    backward the K/V again and their fp32 gradients cp times. The ulysses mode's two all-to-alls send
    (cp - 1) / cp of q, k, v and of the output in the forward, their gradients in the backward."""
    a = w.arch
    kv = layout.micro_batch * w.seq_len // layout.cp * 2 * a.num_key_value_heads * a.head_dim
    forwards = 2 if layout.recompute == "full" else 1
    if (
        layout.cp_mode == "ulysses"
    ):  # parallel/ulysses.py: q, k, v and the output, each way, (cp-1)/cp of them
        q = kv // (2 * a.num_key_value_heads) * a.num_attention_heads
        return a.num_hidden_layers * (forwards + 1) * (q + kv + q) * e * (layout.cp - 1) / layout.cp
    return a.num_hidden_layers * ((forwards + 1) * (layout.cp - 1) * kv * e + layout.cp * kv * 4)


def _data_parallel_bytes(w: Workload, layout: Layout, pbytes: int, micro_per_rank: int) -> float:
    """Bytes one data rank sends per step: the gradients' all-reduce (the routed experts', 1/ep of them on a
    rank, over their replica group only); under sharding stage 3 a reduce-scatter of the gradients (half an
    all-reduce) and every weight, frozen ones too, gathered in the forward and again in the backward of each
    micro-batch."""
    a = w.arch
    trainable = (
        a.num_hidden_layers * lora_layer_params(w, 1) if w.finetuning == "lora" else count_parameters(a)
    )
    d = layout.data_ranks
    routed = _routed_expert_params(w) if layout.ep > 1 else 0
    replicas = d // layout.ep
    grads = 2 * (d - 1) / d * (trainable - routed) + 2 * (replicas - 1) / replicas * routed / layout.ep
    if layout.sharding > 1 and layout.stage == 3:
        return (
            (grads / 2 + micro_per_rank * 2 * (d - 1) / d * count_parameters(a))
            * pbytes
            / (layout.tp * layout.pp)
        )
    return grads * pbytes / (layout.tp * layout.pp)


def _routed_expert_params(w: Workload) -> int:
    """Parameters of every routed expert of the model (full fine-tuning trains them; LoRA under expert
    parallel keeps its adapters off the experts, validate-config refuses them there)."""
    a = w.arch
    return (
        0
        if w.finetuning == "lora"
        else sparse_layers(a) * a.num_experts * 3 * a.hidden_size * a.moe_intermediate_size
    )


def _all_to_all_bytes(w: Workload, layout: Layout, e: int) -> float:
    """Bytes one rank of an expert group sends per micro-batch (parallel/expert_parallel.py): in every sparse
    layer the k routed rows of each token go out to the experts' ranks and come back (the dispatch and the
    combine), forward and backward, and again when the forward is recomputed; (ep - 1) / ep of them leave
    the rank."""
    a = w.arch
    rows = w.micro_sequences(layout) * w.seq_len * a.num_experts_per_tok
    exchanges = 6 if layout.recompute == "full" else 4
    layers = -(-sparse_layers(a) // layout.pp)
    return layers * exchanges * rows * a.hidden_size * e * (layout.ep - 1) / layout.ep


def _complexity(layout: Layout) -> int:
    """Tie-breaker: simpler layouts first (fewer axes, lower stage, no offload)."""
    return (
        (layout.tp > 1)
        + (layout.pp > 1)
        + (layout.sharding > 1) * layout.stage
        + 2 * layout.offload_optimizer
        + 3 * layout.offload_params
        + (layout.recompute != "none")
        + (layout.cp > 1)
        + (layout.ep > 1)
    )


def context_degrees(w: Workload, tp: int, pp: int, ranks: int) -> List[int]:
    """The context-parallel degrees validate-config accepts for ``ranks`` ranks per model replica
    (config/context_checks.py): groups laid inside the data-parallel axis (no tensor or pipeline axis),
    rows of single sequences, lengths divisible by 2 x the degree."""
    if tp > 1 or pp > 1 or w.method.sample != "sequence":
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or w.seq_len % (2 * c) == 0]


def expert_degrees(w: Workload, ranks: int) -> List[int]:
    """The expert-parallel degrees that split every MoE layer's experts evenly over some of ``ranks`` data
    ranks (1 for a dense model); which of them a config admits with the other axes is validate-config's to
    say (``admits`` of :func:`search`)."""
    return [e for e in _divisors(ranks) if e == 1 or (w.arch.num_experts and w.arch.num_experts % e == 0)]


def enumerate_layouts(w: Workload, world: int, device: Device) -> List[Layout]:
    a = w.arch
    out: List[Layout] = []
    for tp in _divisors(world):
        if tp > device.gpus_per_node or a.num_attention_heads % tp or a.num_key_value_heads % tp:
            continue
        if tp > 1 and (a.vocab_size % tp or a.intermediate_size % tp or tensor_parallel_problem(a, tp)):
            continue
        for pp in _divisors(world // tp):
            if pp > a.num_hidden_layers:
                continue
            for cp in context_degrees(w, tp, pp, world // (tp * pp)):
                for ep in expert_degrees(w, world // (tp * pp * cp)):
                    out += _data_layouts(w, world, tp, pp, cp, ep)
    return out


def _data_layouts(w: Workload, world: int, tp: int, pp: int, cp: int, ep: int = 1) -> List[Layout]:
    """The layouts of the data axes, micro batch, recompute and offload for one (tp, pp, cp, ep)."""
    out: List[Layout] = []
    ranks = world // (tp * pp * cp)  # data ranks, ep of which split the experts
    if w.global_batch % ranks:
        return out
    per_rank = w.global_batch // ranks
    replicas = ranks // ep
    shard_opts = (
        [(replicas, 1, 1)]
        if replicas == 1 or cp > 1 or ep > 1  # context and expert parallel compose with plain data parallel
        else [(replicas, 1, 1)] + [(1, replicas, st) for st in (1, 2, 3) if not (st >= 2 and pp > 1)]
    )
    for dp, sharding, stage in shard_opts:
        for mb in (1, 2, 4, 8, 16, 32):
            if per_rank % mb:
                continue
            for rec in ("none", "attention", "full"):
                offloads = [(False, False)]
                if world == 1:
                    offloads.append((True, False))
                if sharding > 1 and stage == 3:
                    offloads += [(True, False), (True, True)]
                for off_opt, off_par in offloads:
                    out.append(
                        Layout(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            sharding=sharding,
                            stage=stage,
                            micro_batch=mb,
                            recompute=rec,
                            offload_optimizer=off_opt,
                            offload_params=off_par,
                            pipeline_micro_batches=(per_rank // mb) if pp > 1 else None,
                            cp=cp,
                            ep=ep,
                        )
                    )
    return out


def layout_axes(layout: Layout) -> Tuple[int, ...]:
    """The layout's parallel axes in the order of config/layout_admission.py's AXES."""
    return (layout.dp, layout.tp, layout.pp, layout.sharding, layout.stage, layout.cp, layout.ep)


def search(
    w: Workload,
    device: Device,
    gpus: int,
    nodes: int = 1,
    top: int = 10,
    admits: Optional[Callable[[Tuple[int, ...]], bool]] = None,
) -> Dict[str, Any]:
    """Rank the layouts of ``gpus`` x ``nodes`` devices that fit. ``admits``: whether the config accepts a
    layout's axes (:func:`layout_axes`); ``bmtrain plan`` passes validate-config's checks. Returns best,
    ranked (top), counts."""
    world = gpus * nodes
    device = replace(device, gpus_per_node=gpus)
    fitting: List[Candidate] = []
    tried = 0
    for layout in enumerate_layouts(w, world, device):
        if admits is not None and not admits(layout_axes(layout)):
            continue
        tried += 1
        mem = estimate_layout(w, layout, device)
        if not mem.fits:
            continue
        parts = step_time(w, layout, device, nodes)
        fitting.append(Candidate(layout, mem, parts["total"], parts))
    # times within 0.5% count as equal; then the smaller peak (more headroom) wins
    fitting.sort(
        key=lambda c: (
            round(math.log(c.step_time_s * (1 + 0.01 * _complexity(c.layout))) / math.log(1.005)),
            c.memory.required,
        )
    )
    return {
        "best": fitting[0] if fitting else None,
        "ranked": fitting[:top],
        "tried": tried,
        "fitting": len(fitting),
    }


def longest_sequence(w: Workload, layout: Layout, device: Device, limit: int = 1 << 22) -> int:
    """The longest row (tokens, a multiple of 2 x the context degree) whose estimate fits ``device`` under
    ``layout``; 0 when not even the shortest fits. The estimate grows with the row, so a bisection."""
    step = 2 * layout.cp

    def fits(n: int) -> bool:
        return estimate_layout(replace(w, seq_len=n * step), layout, device).fits

    lo, hi = 0, limit // step  # fits(lo) (or lo = 0), hi is the bound
    if fits(hi):
        return hi * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * step


def yaml_block(layout: Layout) -> str:
    """The layout as ready-to-paste config sections."""
    lines = [
        "parallel_config:",
        f"  data_parallel: {layout.dp}",
        f"  tensor_parallel: {layout.tp}",
        f"  pipeline_parallel: {layout.pp}",
        f"  sharding_parallel: {layout.sharding}",
        f"  sharding_stage: {layout.stage}",
    ]
    if layout.cp > 1:
        lines.append(f"  context_parallel: {layout.cp}")
    if layout.ep > 1:
        lines.append(f"  expert_parallel: {layout.ep}")
    if layout.offload_optimizer:
        lines.append("  offload_optimizer: true")
    if layout.offload_params:
        lines.append("  offload_params: true")
    if layout.pipeline_micro_batches:
        lines.append(f"  pipeline_micro_batches: {layout.pipeline_micro_batches}")
    lines += [
        "train_config:",
        f"  micro_batch_size: {layout.micro_batch}",
        f"  gradient_checkpointing: {'true' if layout.recompute != 'none' else 'false'}",
    ]
    if layout.recompute != "none":
        lines.append(f"  recompute_granularity: {layout.recompute}")
    return "\n".join(lines)
