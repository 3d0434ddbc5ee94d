"""Layout search: enumerate (dp, tp, pp, sharding stage, context parallel, recompute, micro batch, offload)
for a number of devices, keep the layouts that fit, and rank them by an estimated step time; and the longest
sequence a layout fits (:func:`longest_sequence`).

Step time = compute (model FLOPs / (device peak x efficiency)), plus the pipeline bubble, plus the
communication that does not overlap: the data-parallel gradient all-reduce (or the sharded
reduce-scatter + all-gather), tensor-parallel all-reduces of every layer, pipeline sends, the context
group's ring exchanges of K/V (and their gradients) in every layer, and host copies when offloading. Bandwidth is the intra-node link when a group fits in a node, else the
inter-node one. It is a ranking model, not a stopwatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List

from bmtrain_cli.models.moe import tensor_parallel_problem
from bmtrain_cli.models.param_count import count_parameters
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
    # every weight but the input embedding (a lookup) is a matmul; a tied matrix counts once, as the head
    n_matmul = count_parameters(a) - (0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size)
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
        if w.finetuning == "lora":
            trainable = a.num_hidden_layers * lora_layer_params(w, 1)
        else:
            trainable = count_parameters(a)
        grad_bytes = trainable * pbytes / (layout.tp * layout.pp)
        d = layout.data_ranks
        volume = 2 * (d - 1) / d * grad_bytes
        if layout.sharding > 1 and layout.stage == 3:
            volume *= 1.5  # weights gathered again in the backward
        dp_comm = volume / bw(d, layout.tp)
        dp_comm *= 0.5  # bucketed all-reduce overlaps with the backward of earlier layers

    pp_comm = 0.0
    if layout.pp > 1:
        msg = layout.micro_batch * w.seq_len * a.hidden_size * e
        pp_comm = 2 * micro_per_rank * msg / bw(layout.pp, layout.tp * layout.data_ranks)

    cp_comm = micro_per_rank * _ring_bytes(w, layout, e) / bw(layout.cp, layout.tp) if layout.cp > 1 else 0.0
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
        "offload": offload,
    }
    parts["total"] = sum(parts.values())
    return parts


def _ring_bytes(w: Workload, layout: Layout, e: int) -> float:
    """Bytes one rank of a context group sends per micro-batch (parallel/ring_attention.py, blocking
    send/recv, so none of it overlaps): each layer's forward passes this rank's K/V on cp - 1 times, its
    backward the K/V again and their fp32 gradients cp times."""
    a = w.arch
    kv = layout.micro_batch * w.seq_len // layout.cp * 2 * a.num_key_value_heads * a.head_dim
    forwards = 2 if layout.recompute == "full" else 1
    return a.num_hidden_layers * ((forwards + 1) * (layout.cp - 1) * kv * e + layout.cp * kv * 4)


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
    )


def context_degrees(w: Workload, tp: int, pp: int, ranks: int) -> List[int]:
    """The context-parallel degrees validate-config accepts for ``ranks`` ranks per model replica
    (config/context_checks.py): groups laid inside the data-parallel axis (no tensor or pipeline axis),
    rows of single sequences, lengths divisible by 2 x the degree."""
    if tp > 1 or pp > 1 or w.method.sample != "sequence":
        return [1]
    return [c for c in _divisors(ranks) if c == 1 or w.seq_len % (2 * c) == 0]


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
                out += _data_layouts(w, world, tp, pp, cp)
    return out


def _data_layouts(w: Workload, world: int, tp: int, pp: int, cp: int) -> List[Layout]:
    """The layouts of the data axes, micro batch, recompute and offload for one (tp, pp, cp)."""
    out: List[Layout] = []
    ranks = world // (tp * pp * cp)
    if w.global_batch % ranks:
        return out
    per_rank = w.global_batch // ranks
    shard_opts = (
        [(ranks, 1, 1)]
        if ranks == 1 or cp > 1  # context parallel composes with plain data parallel
        else [(ranks, 1, 1)] + [(1, ranks, st) for st in (1, 2, 3) if not (st >= 2 and pp > 1)]
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
                        )
                    )
    return out


def search(w: Workload, device: Device, gpus: int, nodes: int = 1, top: int = 10) -> Dict[str, Any]:
    """Rank the layouts of ``gpus`` x ``nodes`` devices that fit. Returns best, ranked (top), counts."""
    world = gpus * nodes
    device = replace(device, gpus_per_node=gpus)
    fitting: List[Candidate] = []
    tried = 0
    for layout in enumerate_layouts(w, world, device):
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
