"""Per-device memory of a training layout: parameters, gradients, optimizer states and fp32 master
weights, activations (with and without recompute, by granularity), logits and loss, communication
buffers; and whether it fits a device.

The model is the tensors the code actually keeps. Per decoder layer and token, autograd keeps the layer
input and the two RMSNorm outputs' inputs/outputs (4 x hidden), q/k/v as they enter the attention core
(k/v repeated to the query heads only by the score-keeping kernels), the attention output, the MLP
gate/up inputs of SwiGLU and its output (3 x intermediate); the attention core adds its softmax
(heads x seq per token) unless it is a flash or blocked kernel (models/attention_choice.py) or
recomputed. Tensor parallelism divides everything but the hidden-size tensors (no sequence
parallel). Full recompute keeps only each layer's input and rebuilds one layer at a time in backward.

Two targets are predicted:

* GPU: ``paddle.device.cuda.max_memory_allocated()`` (the allocator's peak), plus a runtime reserve
  (CUDA context, workspaces) and allocator headroom for the fit check.
* CPU: the same quantity from Paddle's host allocator statistics (what ``bmtrain train`` writes to
  summary.json as peak_memory_bytes; checked by tests/unit/plan/test_calibration.py against real runs).
  The fit check adds the process (Python, Paddle's libraries) and the checkpoint save's numpy copies.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from bmtrain_cli.config.env import find_cxx
from bmtrain_cli.models.arch import (
    LORA_PROJECTIONS,
    ModelArch,
    count_parameters,
    lora_parameters_per_layer,
    lora_targets,
)
from bmtrain_cli.models.attention_choice import ATTENTION_BLOCK, choose_kernel, training_mask_kind
from bmtrain_cli.plan.devices import Device, format_bytes

# --- CPU: the process around the tensors (Python, Paddle's libraries and thread pools; ~0.4 GiB resident
# on Paddle 3.3.1), counted by the fit check only. See docs/plan.md "What is measured".
CPU_RUNTIME_BYTES = 512 << 20
# --- GPU allocator headroom for the fit check (auto_growth fragmentation)
GPU_FRAGMENTATION = 0.05
# Chunk of the fused linear + cross-entropy (bmtrain_cli/ops/custom.py CHUNK_ELEMENTS)
CE_CHUNK_ELEMENTS = 1 << 23
DP_BUCKET_BYTES = 25 << 20  # Paddle's fused gradient all-reduce bucket
# score-sized [b, heads, block, s] fp32 temporaries alive at once in the blocked attention's backward:
# the probabilities, the gradient of the probabilities and the intermediate products of the score gradient
# (counted from models/attention.py; the calibration cases with long rows and few heads agree)
BLOCKED_TEMPORARIES = 6


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the memory-relevant training options."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: int = 1
    stage: int = 1
    micro_batch: int = 1
    recompute: str = "none"  # none | full | attention
    recompute_layers: Optional[int] = None  # first N layers (None: all)
    offload_optimizer: bool = False
    offload_params: bool = False
    pipeline_micro_batches: Optional[int] = None

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.sharding

    @property
    def data_ranks(self) -> int:
        return self.dp * self.sharding

    @classmethod
    def from_config(cls, config: Any) -> Layout:
        p, t = config.parallel, config.train
        granularity = t.recompute_granularity if t.gradient_checkpointing else "none"
        return cls(
            dp=p.data_parallel,
            tp=p.tensor_parallel,
            pp=p.pipeline_parallel,
            sharding=p.sharding_parallel,
            stage=p.sharding_stage,
            micro_batch=t.micro_batch_size,
            recompute=granularity,
            recompute_layers=t.recompute_num_layers if granularity != "none" else None,
            offload_optimizer=p.offload_optimizer,
            offload_params=p.offload_params,
            pipeline_micro_batches=p.pipeline_micro_batches,
        )

    def describe(self) -> str:
        parts = [f"dp {self.dp}", f"tp {self.tp}", f"pp {self.pp}"]
        if self.sharding > 1:
            parts.append(f"sharding {self.sharding} (stage {self.stage})")
        parts.append(f"micro batch {self.micro_batch}")
        parts.append("recompute " + (self.recompute if self.recompute != "none" else "off"))
        if self.offload_optimizer:
            parts.append("optimizer offload")
        if self.offload_params:
            parts.append("parameter offload")
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: the architecture and the per-sample shape, precision and method."""

    arch: ModelArch
    seq_len: int
    global_batch: int
    precision: str = "fp32"  # fp32 | bf16 | fp16
    amp_level: str = "O2"
    finetuning: str = "full"  # full | lora
    lora_rank: int = 8
    lora_targets: Tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    attention: str = "auto"
    kernels: str = "auto"
    packed: bool = False  # batching: packed (segment ids reach the attention; else no mask at all)
    note: str = ""  # what the plan assumed about the data (plan/data_facts.py)

    @classmethod
    def from_config(
        cls,
        config: Any,
        arch: Optional[ModelArch] = None,
        seq_len: Optional[int] = None,
        read_data: bool = True,
    ) -> Workload:
        """``arch``/``seq_len``: what the trainer built and the longest batch it will see; without them the
        tokenizer and (for ``batching: longest``) the data are read as the trainer will read them, unless
        ``read_data`` is False (then batches are assumed to reach max_seq_len)."""
        from bmtrain_cli.config.derived import derive
        from bmtrain_cli.models.arch import arch_from_model_config
        from bmtrain_cli.plan.data_facts import DataFacts, data_facts

        m, t = config.model, config.train
        facts = DataFacts()
        wants_longest = seq_len is None and t.batching == "longest" and read_data
        if arch is None or wants_longest:
            facts = data_facts(config, need_vocab=arch is None, need_longest=wants_longest)
        if arch is None:
            arch = arch_from_model_config(m, allow_known=True)
            # a fresh model takes its tokenizer's vocabulary
            if facts.vocab_size and not m.model_name_or_path:
                arch = replace(arch, vocab_size=facts.vocab_size)
        if seq_len is None:
            seq_len = facts.longest or m.max_seq_len
        targets = lora_targets(arch, t.lora_target_modules)
        return cls(
            arch=arch,
            seq_len=int(seq_len),
            global_batch=derive(config).global_batch_size,
            precision=t.precision,
            amp_level=t.amp_level,
            finetuning=t.finetuning,
            lora_rank=t.lora_rank,
            lora_targets=tuple(targets),
            lora_dropout=t.lora_dropout,
            attention=m.attention_implementation,
            kernels=m.kernels,
            packed=t.batching == "packed",
            note=facts.note,
        )


@dataclass
class MemoryEstimate:
    """Bytes per device of the worst pipeline stage (and host bytes when offloading)."""

    device: Device
    layout: Layout
    stage_index: int
    parameters: int
    gradients: int
    optimizer_states: int
    master_weights: int
    activations: int
    activations_by_recompute: Dict[str, int]
    logits: int
    comm_buffers: int
    transient: int
    runtime: int
    peak: int  # what summary.json's peak_memory_bytes measures
    required: int  # peak + runtime reserve + allocator headroom: compared with the device memory
    host_bytes: int
    total_parameters: int
    trainable_parameters: int
    notes: List[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.required <= self.device.memory_bytes

    def to_dict(self) -> Dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("device", "layout")}
        out["device"] = self.device.name
        out["device_memory_bytes"] = self.device.memory_bytes
        out["layout"] = asdict(self.layout)
        out["fits"] = self.fits
        return out

    def lines(self) -> List[str]:
        f = format_bytes
        lay = self.layout
        rec = self.activations_by_recompute
        where = f" (pipeline stage {self.stage_index}, the largest)" if lay.pp > 1 else ""
        opt_where = " [host]" if lay.offload_optimizer else ""
        out = [
            f"per-device memory on {self.device.name}{where}: {lay.describe()}",
            f"  parameters       {f(self.parameters):>12}   "
            f"({self.trainable_parameters:,} trainable of {self.total_parameters:,})",
            f"  gradients        {f(self.gradients):>12}",
            f"  optimizer states {f(self.optimizer_states):>12}{opt_where}",
            f"  master weights   {f(self.master_weights):>12}{opt_where}",
            f"  activations      {f(self.activations):>12}   "
            f"(recompute off {f(rec['none'])}, attention {f(rec['attention'])}, full {f(rec['full'])})",
            f"  logits and loss  {f(self.logits):>12}",
            f"  comm buffers     {f(self.comm_buffers):>12}",
            f"  transient        {f(self.transient):>12}",
        ]
        out.append(f"  peak             {f(self.peak):>12}   (live tensors; summary.json peak_memory_bytes)")
        if self.host_bytes:
            out.append(f"  host memory      {f(self.host_bytes):>12}   (offloaded)")
        verdict = "fits" if self.fits else "does NOT fit"
        out.append(
            f"  => needs {f(self.required)} of {f(self.device.memory_bytes)}: {verdict}"
            + (
                " (incl. the process and the checkpoint save)"
                if self.device.kind == "cpu"
                else " (incl. runtime reserve and allocator headroom)"
            )
        )
        out += [f"  note: {n}" for n in self.notes]
        return out


# ----------------------------------------------------------------------------------------------
# parameter accounting


def _layer_params(arch: ModelArch, tp: int) -> Tuple[int, int]:
    """(matrix elements per device, replicated vector elements) of one decoder layer."""
    h, hd = arch.hidden_size, arch.head_dim
    q = arch.num_attention_heads * hd
    kv = arch.num_key_value_heads * hd
    mats = (h * (q + 2 * kv) + q * h + 3 * h * arch.intermediate_size) // tp
    vecs = 2 * h
    if arch.attention_bias:
        mats += (q + 2 * kv) // tp
    if arch.qk_norm:
        vecs += 2 * hd
    return mats, vecs


def _lora_layer_params(w: Workload, tp: int) -> int:
    return lora_parameters_per_layer(w.arch, w.lora_rank, w.lora_targets, tp)


def stage_layers(num_layers: int, pp: int) -> List[int]:
    """Decoder layers per pipeline stage (uniform partition: earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


# ----------------------------------------------------------------------------------------------
# activations


def _attention_kernel(w: Workload, device: Device, layout: Layout) -> str:
    """The kernel training runs (models/attention_choice.py): a flash or blocked one keeps no score
    matrix; sdpa and eager on a CPU keep the softmax probabilities [b, heads, s, s] of every layer."""
    kind = training_mask_kind(w.arch, w.seq_len, w.packed, layout.pp > 1)
    gpu = device.kind != "cpu"
    return choose_kernel(kind, w.attention, gpu and w.precision in ("bf16", "fp16"), gpu)[0]


def _keeps_scores(kernel: str, device: Device) -> bool:
    """Whether the attention keeps an s x s probability matrix per layer (Paddle's sdpa is its math
    composition on a CPU; on a GPU it picks a flash or memory-efficient kernel)."""
    return kernel == "eager" or (kernel.startswith("sdpa") and device.kind == "cpu")


def _unfused_elems(w: Workload, device: Device, tp: int) -> float:
    """Elements per token a layer keeps beyond the fused kernels' when ops run as compositions of Paddle
    ops (bmtrain_cli/ops/reference.py): ``kernels: reference`` everywhere; ``kernels: paddle`` on a CPU,
    which has Paddle's fused SwiGLU but not its RMSNorm or rotary kernels."""
    a = w.arch
    kernels = w.kernels
    if kernels == "auto" and device.kind == "cpu" and find_cxx() is None:
        kernels = "paddle"  # what ops.select("auto") falls back to without a compiler
    ref_all = kernels == "reference"
    ref_norm_rotary = ref_all or (kernels == "paddle" and device.kind == "cpu")
    extra = 0.0
    if ref_norm_rotary:
        # each RMSNorm keeps its fp32 normalised input for the weight's gradient; rotary keeps the
        # rotated-half copies of q and k
        extra += 2 * a.hidden_size * 4 / _act_bytes(w)
        extra += (a.num_attention_heads + a.num_key_value_heads) * a.head_dim / tp
    if ref_all:
        extra += a.intermediate_size / tp  # silu(gate), kept for the product with up
    return extra


def _layer_activation_elems(w: Workload, device: Device, layout: Layout, mode: str) -> Tuple[float, float]:
    """(elements kept per token of one layer, of which hidden-size), for mode none|attention|full."""
    a = w.arch
    h, hd = a.hidden_size, a.head_dim
    q = a.num_attention_heads * hd
    kv = a.num_key_value_heads * hd
    n_rep = a.num_attention_heads // a.num_key_value_heads
    tp = layout.tp
    heads = a.num_attention_heads / tp
    if mode == "full":
        return float(h), float(h)
    hidden_part = 4 * h  # layer input, input-norm output, attention residual, post-norm output
    kernel = _attention_kernel(w, device, layout)
    scores = _keeps_scores(kernel, device)
    # q, k, v as the attention core keeps them: the score-keeping compositions repeat K/V to the query
    # heads (eager and sdpa's math path); the flash and blocked kernels keep K/V with their own heads
    core_in = (3 * q if (n_rep > 1 and scores) else q + 2 * kv) / tp
    attn_out = q / tp
    mlp = 3 * a.intermediate_size / tp  # gate, up (SwiGLU inputs), SwiGLU output
    core = 0.0
    if mode == "none":
        if scores:
            core = heads * w.seq_len  # softmax probabilities [b, heads, s, s] (per token: heads x s)
        else:
            core = heads  # log-sum-exp
    if a.qk_norm:
        core_in += (q + kv) / tp  # q/k before their norm
    core_in += _unfused_elems(w, device, tp)
    if w.finetuning == "lora":
        n_targets = len([t for t in w.lora_targets if t in LORA_PROJECTIONS])
        core_in += n_targets * w.lora_rank + (n_targets * h if w.lora_dropout > 0 else 0)
    return hidden_part + core_in + attn_out + mlp + core, float(hidden_part)


def _act_bytes(w: Workload) -> int:
    return 2 if w.precision in ("bf16", "fp16") else 4


def layer_activations(
    w: Workload, device: Device, layout: Layout, layers: int, mode: str
) -> List[Tuple[int, int]]:
    """Per layer, first to last: (bytes kept after the forward of one micro-batch, working set of its
    backward). Recompute applies to the first ``recompute_layers`` layers (all when None); a recomputed
    layer's backward first rebuilds what it did not keep."""
    tokens = layout.micro_batch * w.seq_len
    e = _act_bytes(w)
    n_rec = (
        0
        if mode == "none"
        else (layers if layout.recompute_layers is None else min(layers, layout.recompute_layers))
    )
    full_layer, _ = _layer_activation_elems(w, device, layout, "none")
    kept_rec, _ = _layer_activation_elems(w, device, layout, mode)
    a = w.arch
    # the MLP's backward (the gradients of its largest tensors), then the attention core's, by which time
    # the MLP's kept tensors (gate, up, SwiGLU output, the post-attention norm's input and output) are
    # freed. A score-keeping kernel adds the gradients of the probabilities and of the scores
    # [b, heads, s, s] while the probabilities are still held (measured: +2 score matrices). The blocked
    # kernel's backward holds grouped copies of q, the output and its gradient, the query-gradient blocks,
    # fp32 K/V gradient accumulators, and one block's fp32 score-sized temporaries [b, heads, block, s].
    work = (a.hidden_size + 1.5 * a.intermediate_size / layout.tp) * tokens * e
    kernel = _attention_kernel(w, device, layout)
    heads = a.num_attention_heads / layout.tp
    mlp_freed = 3 * a.intermediate_size / layout.tp + 2 * a.hidden_size
    if _keeps_scores(kernel, device):
        work = max(work, (2 * heads * w.seq_len - mlp_freed) * tokens * e)
    elif kernel == "blocked":
        q_el, kv_el = heads * a.head_dim, a.num_key_value_heads * a.head_dim / layout.tp
        per_token = (
            4 * q_el
            + 2 * kv_el * 4 / e
            + BLOCKED_TEMPORARIES * heads * min(ATTENTION_BLOCK, w.seq_len) * 4 / e
        )
        work = max(work, (per_token - mlp_freed) * tokens * e)
    out = []
    for i in range(layers):
        if i < n_rec:
            out.append((int(kept_rec * tokens * e), int(work + (full_layer - kept_rec) * tokens * e)))
        else:
            out.append((int(full_layer * tokens * e), int(work)))
    return out


def _loss_bytes(w: Workload, device: Device, layout: Layout, last_stage: bool) -> Tuple[int, int]:
    """(bytes kept for the loss's backward, transient peak while computing it) on the last stage."""
    if not last_stage:
        return 0, 0
    a = w.arch
    n = layout.micro_batch * (w.seq_len - 1)
    h, vocab = a.hidden_size, a.vocab_size // layout.tp
    e = _act_bytes(w)
    head_elems = h * vocab
    final = h * layout.micro_batch * w.seq_len * e  # final norm input
    if layout.tp == 1 and w.kernels != "reference":
        # fused linear + cross-entropy in chunks: keeps d(hidden) and d(weight) (fp32 accumulators);
        # transient: a contiguous copy of the hidden states, a chunk's logits and their gradient, and
        # the chunk's weight-gradient part
        kept = final + n * h * 4 + head_elems * 4
        chunk = min(n * vocab, max(vocab, (CE_CHUNK_ELEMENTS // vocab) * vocab))
        transient = 2 * chunk * 4 + head_elems * 4 + n * h * e
        if w.finetuning == "lora":
            kept -= head_elems * 4
            transient -= head_elems * 4
        return int(kept), int(transient)
    # materialised logits (vocab-parallel cross-entropy, or the reference ops): logits, fp32 softmax,
    # and their gradient
    logits = n * vocab
    return int(final + logits * (e + 4)), int(logits * 4 * 2)


# ----------------------------------------------------------------------------------------------
# the estimate


def estimate_layout(w: Workload, layout: Layout, device: Device) -> MemoryEstimate:
    """Memory of ``layout`` for ``w`` on ``device``: the worst pipeline stage."""
    best: Optional[MemoryEstimate] = None
    n_stages = layout.pp
    for idx, layers in enumerate(stage_layers(w.arch.num_hidden_layers, n_stages)):
        est = _stage_estimate(w, layout, device, idx, layers)
        if best is None or est.peak > best.peak:
            best = est
    assert best is not None
    return best


def _stage_estimate(w: Workload, layout: Layout, device: Device, idx: int, layers: int) -> MemoryEstimate:
    a = w.arch
    notes: List[str] = [w.note] if w.note else []
    tp, pp = layout.tp, layout.pp
    first, last = idx == 0, idx == pp - 1
    cpu = device.kind == "cpu"
    precision = w.precision
    if cpu and precision != "fp32":
        notes.append(f"precision {precision} does not run on CPU; estimated as fp32")
        precision = "fp32"
        w = replace(w, precision="fp32")

    # --- parameters of this stage
    mats, vecs = _layer_params(a, tp)
    emb = a.vocab_size * a.hidden_size // tp
    stage_params = layers * (mats + vecs)
    if first:
        stage_params += emb
    if last:
        stage_params += a.hidden_size  # final norm
        if not a.tie_word_embeddings or pp > 1:
            stage_params += emb  # LM head (a tied head is a second copy on the last stage)
    largest = max(emb, a.hidden_size * a.intermediate_size // tp)
    if w.finetuning == "lora":
        trainable = layers * _lora_layer_params(w, tp)
        frozen = stage_params
        largest = max(_lora_layer_params(w, tp), 1)
    else:
        trainable, frozen = stage_params, 0
    low = precision in ("bf16", "fp16")
    pbytes = 2 if (low and w.amp_level == "O2") else 4
    S = layout.sharding
    params = (frozen + trainable) * pbytes
    grads = trainable * pbytes
    master = trainable * 4 if (low and w.amp_level == "O2") else 0
    opt = trainable * 8  # AdamW moment1 + moment2 (fp32)
    if S > 1:
        opt //= S
        master //= S
        if layout.stage >= 2:
            grads //= S
        if layout.stage >= 3:
            params //= S
    host = 0
    if layout.offload_optimizer:
        host += opt + master + (trainable * 4 if not master else 0)
        opt = master = 0
    if layout.offload_params and S > 1 and layout.stage == 3:
        host += params
        params = (mats + vecs) * pbytes * 2  # the layers being gathered
    elif layout.offload_params:
        # group-sharded stage 3 is what offloads parameters; without it training does not (and
        # validate-config refuses the setting): no saving is counted
        notes.append("offload_params needs sharding_parallel > 1 with sharding_stage 3: not counted")

    # --- activations
    in_flight = 1
    if pp > 1:
        micro = layout.pipeline_micro_batches or max(
            1, w.global_batch // (layout.micro_batch * layout.data_ranks)
        )
        in_flight = min(pp - idx, micro)  # 1F1B: stage i holds pp - i micro-batches
    per_mode = {
        mode: layer_activations(w, device, layout, layers, mode) for mode in ("none", "attention", "full")
    }
    by_mode = {mode: sum(k for k, _ in per) * in_flight for mode, per in per_mode.items()}
    per_layer = per_mode[layout.recompute]
    acts = by_mode[layout.recompute]
    work = max((wk for _, wk in per_layer), default=0)  # the largest backward working set of a layer
    tokens = layout.micro_batch * w.seq_len
    e = _act_bytes(w)
    if _attention_kernel(w, device, layout) in ("sdpa_mask", "eager"):
        acts += layout.micro_batch * w.seq_len * w.seq_len * e  # the additive mask [b, 1, s, s]
    if first:
        acts += 2 * tokens * a.head_dim * 4  # cos/sin tables (fp32)
    loss_kept, loss_transient = _loss_bytes(w, device, layout, last)

    # --- communication buffers
    comm = 0
    if layout.data_ranks > 1 and not cpu:
        comm += 2 * DP_BUCKET_BYTES
    if pp > 1:
        comm += 2 * tokens * a.hidden_size * e  # send / receive activations and their gradients
    if tp > 1:
        comm += tokens * a.hidden_size * e  # all-reduce output of a row-parallel layer
    if layout.stage == 3 and S > 1:
        comm += 2 * (mats + vecs) * pbytes  # gathered weights of the current and the prefetched layer

    # --- the peak. The trainer frees gradients after each step (clear_grad(set_to_zero=False)), so with
    # one micro-batch per step they grow during the backward while the activations shrink (walk the
    # layers backwards); with accumulation they are there from the second micro-batch on.
    accum = max(1, w.global_batch // (layout.micro_batch * layout.data_ranks))
    held_grads = grads if (accum > 1 or pp > 1) else 0
    static = params + opt + master + comm + held_grads
    loss_phase = acts + loss_kept + loss_transient
    growing = grads - held_grads
    head_grad = min(growing, emb * pbytes if last and w.finetuning != "lora" else 0)
    layer_grad = (growing - head_grad) / max(1, layers + (1 if first else 0))
    shared = acts - by_mode[layout.recompute]  # mask, rope tables
    others = by_mode[layout.recompute] * (in_flight - 1) / in_flight  # micro-batches not in backward
    kept_upto = list(itertools.accumulate(k for k, _ in per_layer))  # layers 0..i still hold theirs
    early_bwd = 0.0
    for i in range(layers - 1, -1, -1):
        alive = shared + others + kept_upto[i] + per_layer[i][1] + head_grad + (layers - i) * layer_grad
        early_bwd = max(early_bwd, alive)
    early_bwd = max(early_bwd, acts + loss_kept + head_grad)
    late_bwd = growing + largest * pbytes  # all gradients, the last one being accumulated
    step = grads - held_grads + 2 * largest * 4  # fp32 norm of the largest gradient, the clip
    if layout.offload_optimizer:
        step += largest * 4  # a gradient copy on its way to the host
    transient = max(loss_transient, work, 2 * largest * 4)
    alloc_peak = static + max(loss_phase, early_bwd, late_bwd, step)

    if cpu:
        # checkpoint save (the final one at least): weights and optimizer states are copied to numpy
        # while the model and the optimizer still hold theirs. Paddle's CPU Tensor.numpy() allocates the
        # copy through Paddle's host allocator, so it is part of the measured peak.
        alloc_peak += host  # offloaded states are host memory: on a CPU the same memory as the rest
        states = opt + master + host
        save = params + states + comm + max(states, 2 * trainable * 4)
        if save > alloc_peak:
            notes.append("the peak is the checkpoint save (host copies of weights and optimizer states)")
        peak = max(alloc_peak, save)
        runtime = CPU_RUNTIME_BYTES
        required = peak + runtime
    else:
        runtime = device.runtime_reserve_bytes + (512 << 20 if layout.world_size > 1 else 0)
        peak = alloc_peak
        required = int(peak * (1 + GPU_FRAGMENTATION)) + runtime
    return MemoryEstimate(
        device=device,
        layout=layout,
        stage_index=idx,
        parameters=int(params),
        gradients=int(grads),
        optimizer_states=int(opt),
        master_weights=int(master),
        activations=int(acts),
        activations_by_recompute={k: int(v) for k, v in by_mode.items()},
        logits=int(loss_kept),
        comm_buffers=int(comm),
        transient=int(transient),
        runtime=int(runtime),
        peak=int(peak),
        required=int(required),
        host_bytes=int(host),
        total_parameters=count_parameters(a)
        + (a.num_hidden_layers * _lora_layer_params(w, 1) if w.finetuning == "lora" else 0),
        trainable_parameters=(
            a.num_hidden_layers * _lora_layer_params(w, 1) if w.finetuning == "lora" else count_parameters(a)
        ),
        notes=notes,
    )


def estimate(
    config: Any,
    device: Any = None,
    *,
    layout: Optional[Layout] = None,
    arch: Optional[ModelArch] = None,
    seq_len: Optional[int] = None,
    read_data: bool = True,
) -> MemoryEstimate:
    """Estimate a config's per-device memory. ``device``: a :class:`Device`, a preset name ('A100-80GB',
    'cpu'), or None for this machine's training device without importing Paddle (a GPU build of
    Paddle: an 80 GB A100-class GPU; else the CPU). ``arch`` and ``seq_len`` override the architecture
    and the longest batch (the trainer passes what it built and what its loader holds); otherwise they
    are read as the trainer will read them (:mod:`bmtrain_cli.plan.data_facts`)."""
    from bmtrain_cli.config.env import paddle_has_gpu
    from bmtrain_cli.plan.devices import get_device

    if device is None:
        device = get_device("A100-80GB") if paddle_has_gpu() else get_device("cpu")
    elif isinstance(device, str):
        device = get_device(device)
    w = Workload.from_config(config, arch=arch, seq_len=seq_len, read_data=read_data)
    return estimate_layout(w, layout or Layout.from_config(config), device)


def training_arch(config: Any, vocab_size: Optional[int] = None) -> ModelArch:
    """The architecture the trainer will build: the checkpoint's, or the config's with the tokenizer's
    vocabulary for a fresh model."""
    from bmtrain_cli.config.checks import fresh_vocab_size
    from bmtrain_cli.models.arch import arch_from_model_config

    arch = arch_from_model_config(config.model, allow_known=True)
    if vocab_size and not config.model.model_name_or_path:
        arch = replace(
            arch, vocab_size=fresh_vocab_size(config.model.vocab_size, int(vocab_size), "the tokenizer")
        )
    return arch


def training_estimate(
    config: Any, vocab_size: Optional[int] = None, device: Any = None, seq_len: Optional[int] = None
) -> Optional[MemoryEstimate]:
    """The memory plan of the run the trainer is about to build, or None when it cannot be estimated.
    ``device`` defaults to the device this process trains on (imports Paddle); ``seq_len`` is the
    longest batch the trainer's loader will produce."""
    from bmtrain_cli.plan.devices import detect_device

    dev = detect_device() if device is None else device
    if dev.kind == "cpu" and config.parallel.world_size > 1:
        dev = replace(dev, memory_bytes=dev.memory_bytes // config.parallel.world_size)
    from bmtrain_cli.errors import UserError

    try:
        return estimate(
            config, dev, arch=training_arch(config, vocab_size), seq_len=seq_len or config.model.max_seq_len
        )
    except (UserError, ValueError, KeyError, ZeroDivisionError):  # a plan must never stop training
        return None


def memory_warning(est: Optional[MemoryEstimate]) -> Optional[str]:
    """A one-paragraph warning when the estimated peak exceeds the device's memory, else None."""
    if est is None or est.fits:
        return None
    return (
        f"warning: the memory plan estimates {format_bytes(est.required)} per device, more than the "
        f"{format_bytes(est.device.memory_bytes)} of {est.device.name}; training may run out of memory. "
        "Run `bmtrain plan --config ... --search` for a layout that fits (recompute, sharding, offload, LoRA)."
    )


def weights_exceed_device(est: MemoryEstimate) -> bool:
    """The weights alone (not an estimate: their exact size) are larger than the device's memory."""
    return est.parameters > est.device.memory_bytes


def check_weights_fit(est: Optional[MemoryEstimate]) -> None:
    """Refuse, before anything is allocated, a model whose weights alone exceed the device's memory
    (building it would end in a MemoryError or the kernel's out-of-memory kill)."""
    from bmtrain_cli.errors import UserError

    if est is not None and weights_exceed_device(est):
        raise UserError(
            f"the model's weights alone need {format_bytes(est.parameters)} per device, more than the "
            f"{format_bytes(est.device.memory_bytes)} of {est.device.name} (the memory plan estimates "
            f"{format_bytes(est.required)} in all); use a smaller model or more devices "
            "(`bmtrain plan --config ... --search`)"
        )


def default_device(config: Any) -> Device:
    """The device a plan assumes when none is named: a GPU (A100-80GB) for multi-device or mixed-precision
    configs or a GPU build of Paddle, else this machine's CPU. Does not import Paddle."""
    from bmtrain_cli.config.env import paddle_has_gpu
    from bmtrain_cli.plan.devices import get_device

    gpu = config.parallel.world_size > 1 or config.train.precision != "fp32" or paddle_has_gpu()
    return get_device("A100-80GB" if gpu else "cpu")


def summary_line(config: Any) -> Optional[str]:
    """The memory line of `bmtrain validate-config` (None when the architecture is unknown)."""
    from bmtrain_cli.errors import UserError

    try:
        est = estimate(config, default_device(config), read_data=False)
    except UserError:
        return None
    verdict = "fits" if est.fits else "does NOT fit"
    if weights_exceed_device(est):
        verdict += " (the weights alone exceed the device's memory: `bmtrain train` refuses it)"
    elif not est.fits:
        verdict += " (training would likely run out of memory)"
    longest = config.train.batching == "longest"
    return (
        f"  memory     ~{format_bytes(est.peak)} peak per device on {est.device.name}"
        + (" with every batch at max_seq_len" if longest else "")
        + f" (weights {format_bytes(est.parameters)}, activations {format_bytes(est.activations)}): {verdict}; "
        + (
            "bmtrain plan --config ... reads the data for the longest batch"
            if longest
            else "details: bmtrain plan --config ..."
        )
    )
