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

The inputs are plan/workload.py's, the per-layer counts plan/activations.py's.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, List, Optional, Tuple

from bmtrain_cli.machine import MATMUL_PROBE_N
from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.param_count import count_parameters
from bmtrain_cli.plan.activations import (
    act_bytes,
    attention_kernel,
    attention_row,
    context_share,
    dequantization_workspace,
    kernel_choice,
    layer_activations,
    layer_params,
    lora_layer_params,
    loss_bytes,
    no_grad_forward_bytes,
    quantized_layer,
    quantized_vocab,
    stage_layers,
)
from bmtrain_cli.plan.devices import Device, format_bytes
from bmtrain_cli.plan.moe_memory import all_to_all_bytes, moe_note, unheld_experts
from bmtrain_cli.plan.rollout import rollout_memory
from bmtrain_cli.plan.workload import (
    CPU_RUNTIME_BYTES,
    DP_BUCKET_BYTES,
    GPU_FRAGMENTATION,
    Layout,
    MemoryEstimate,
    Workload,
)
from bmtrain_cli.preference.reference_kind import ADAPTERS_OFF, FROZEN_COPY, PRECOMPUTED

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


# C901 and length: one memory model written top to bottom (parameters, states, activations, communication,
# the peak over the step's phases); its ~40 terms feed each other, and the calibration tests check them together.
def _stage_estimate(  # noqa: C901
    w: Workload, layout: Layout, device: Device, idx: int, layers: int
) -> MemoryEstimate:
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
    whole = w  # whole rows (a GRPO rollout samples them on every rank)
    if layout.cp > 1:  # each rank holds 1/cp of every row (parallel/ring_attention.py)
        w = replace(w, seq_len=context_share(w.seq_len, layout.cp))
        how = "the ring attention's" if layout.cp_mode == "ring" else "the ulysses all-to-all's"
        notes.append(
            f"context parallel {layout.cp}: activations of {w.seq_len} tokens per row on each rank "
            f"({how}; calibrated against `bmtrain run` on CPU)"
        )
    if kernel_choice(w, device, layout).origin == "unmeasured":
        notes.append(
            "kernels: auto times the ops on this machine's first run with these shapes and records the "
            "choice (docs/kernels.md); none is recorded yet, so the static order (our kernels) is counted"
        )

    # --- parameters of this stage
    mats, vecs = layer_params(a, tp, layout.ep)
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
        trainable = layers * lora_layer_params(w, tp, layout.ep)
        frozen = stage_params
        largest = max(lora_layer_params(w, tp, layout.ep), 1)
    else:
        trainable, frozen = stage_params, 0
    low = precision in ("bf16", "fp16")
    pbytes = 2 if (low and w.amp_level == "O2") else 4
    S = layout.sharding
    params = (frozen + trainable) * pbytes
    q_elements, q_bytes, q_largest = quantized_layer(w, layout.ep)  # this rank's experts
    if q_elements and w.finetuning == "lora":  # QLoRA: the layers' projections as codes and scales
        workspace = dequantization_workspace(w, device, q_largest, pbytes)
        params += layers * (q_bytes - q_elements * pbytes) + workspace
        notes.append(
            f"base projections in {w.quant_method}: {format_bytes(layers * q_bytes)} of codes and scales "
            f"instead of {format_bytes(layers * q_elements * pbytes)}, plus {format_bytes(workspace)} of "
            "dequantisation workspace"
        )
    v_elements, v_bytes, v_workspace = quantized_vocab(w)
    if v_elements and w.finetuning == "lora":  # the embedding / LM head in int8 (one process: pp 1)
        params += v_bytes - v_elements * pbytes + v_workspace
        notes.append(
            f"embedding/LM head in int8: {format_bytes(v_bytes)} instead of {format_bytes(v_elements * pbytes)}, "
            f"plus {format_bytes(v_workspace)} of head rows dequantised at a time"
        )
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
    tokens = w.micro_sequences(layout) * w.seq_len
    e = act_bytes(w)
    if a.num_experts:
        notes.append(moe_note(a, tokens, e))
    if attention_kernel(w, device, layout) in ("grouped_mask", "sdpa_mask", "eager"):
        row = attention_row(w, layout)
        acts += tokens * row * e * row // w.seq_len  # the additive mask [b, 1, s, s] (s: the kernel's rows)
    if first:
        acts += 2 * tokens * a.head_dim * 4  # cos/sin tables (fp32)
    loss_kept, loss_transient = loss_bytes(w, device, layout, last)
    ref_params = stage_params + (unheld_experts(a, tp, layout.ep, layers) if w.method.sample == "pair" else 0)
    reference, ref_forward = _reference_bytes(
        w, ref_params * pbytes, max(loss_transient, no_grad_forward_bytes(w, device, layout))
    )
    rollout = rollout_memory(whole, device, layout, layers) if w.completion_len else None
    if rollout is not None:
        ref_forward = 0  # stage grpo: the reference's log-probs come with the rollouts, not in the step

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
    if layout.ep > 1:
        rows = all_to_all_bytes(a, tokens, e)
        comm += rows
        notes.append(
            f"expert parallel {layout.ep}: each rank holds {a.num_experts // layout.ep} of the {a.num_experts} "
            f"experts of every sparse layer; all-to-all rows {format_bytes(rows)}"
        )

    # --- the peak. The trainer frees gradients after each step (clear_grad(set_to_zero=False)), so with
    # one micro-batch per step they grow during the backward while the activations shrink (walk the
    # layers backwards); with accumulation they are there from the second micro-batch on.
    accum = max(1, w.global_batch // (layout.micro_batch * layout.data_ranks))
    held_grads = grads if (accum > 1 or pp > 1) else 0
    static = params + reference + opt + master + comm + held_grads
    # the reference's forward (no gradients) runs after the policy's, whose activations and loss tensors
    # are still held
    loss_phase = acts + loss_kept + max(loss_transient, ref_forward)
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
    rollout_peak = 0
    if rollout is not None:  # sampling between two steps: the gradients are freed by then
        rollout_peak = params + reference + opt + master + comm + rollout.peak
        if rollout_peak > alloc_peak:
            notes.append("the peak is the rollout phase (sampling the completions)")
        alloc_peak = max(alloc_peak, rollout_peak)
    if w.reference == PRECOMPUTED and w.finetuning != "lora":
        # the pass before training holds the policy's weights, the copy and a no-gradient forward: less
        # than a training step, whose gradients are as large as the copy (sharding stage 1 at most for dpo)
        notes.append(
            f"reference log-probs precomputed: the frozen copy ({format_bytes(stage_params * pbytes)}) is "
            "dropped before the first step"
        )
    if cpu:
        # checkpoint save (the final one at least): weights and optimizer states are copied to numpy
        # while the model and the optimizer still hold theirs. Paddle's CPU Tensor.numpy() allocates the
        # copy through Paddle's host allocator, so it is part of the measured peak.
        alloc_peak += host  # offloaded states are host memory: on a CPU the same memory as the rest
        states = opt + master + host
        save = params + reference + states + comm + max(states, 2 * trainable * 4)
        # the matmul throughput probe behind the MFU figure (measured_matmul_flops), run before the first
        # step while the weights are live (the optimizer's states come with the first step): measured
        # 36.0 MiB at n 1536, four n x n fp32 matrices (the inputs, their product and a copy)
        probe = params + reference + 4 * MATMUL_PROBE_N**2 * 4
        if max(save, probe) > alloc_peak:
            notes.append(
                "the peak is the checkpoint save (host copies of weights and optimizer states)"
                if save >= probe
                else "the peak is the matmul throughput probe before the first step (MFU's CPU figure)"
            )
        peak = max(alloc_peak, save, probe)
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
        reference_weights=reference,  # an exact size (weights x bytes), no estimate
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
        + (a.num_hidden_layers * lora_layer_params(w, 1) if w.finetuning == "lora" else 0),
        trainable_parameters=(
            a.num_hidden_layers * lora_layer_params(w, 1) if w.finetuning == "lora" else count_parameters(a)
        ),
        notes=notes,
        rollout_cache=rollout.kv_cache if rollout is not None else 0,
        rollout_peak=int(rollout_peak),
    )


def _reference_bytes(w: Workload, weights: int, forward: int) -> Tuple[int, int]:
    """Stage dpo's reference during training (preference/reference.py): (weights held, transient of its
    no-gradient ``forward`` in a step). A precomputed reference is not there; a reference-free loss has
    none."""
    if w.reference == FROZEN_COPY:
        return weights, forward
    if w.reference == ADAPTERS_OFF:
        return 0, forward
    return 0, 0


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
    from bmtrain_cli.machine import paddle_has_gpu
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
    ``device`` defaults to the device this process trains on (imports Paddle; the run's kernel choice is
    then resolved first: :func:`resolve_kernels`); ``seq_len`` is the longest batch the trainer's loader
    will produce."""
    from bmtrain_cli.plan.devices import detect_device

    dev = detect_device() if device is None else device
    if dev.kind == "cpu" and config.parallel.world_size > 1:
        dev = replace(dev, memory_bytes=dev.memory_bytes // config.parallel.world_size)
    from bmtrain_cli.errors import UserError

    try:
        arch = training_arch(config, vocab_size)
        if device is None:
            resolve_kernels(config.model.kernels, arch)
        return estimate(config, dev, arch=arch, seq_len=seq_len or config.model.max_seq_len)
    except (UserError, ValueError, KeyError, ZeroDivisionError):  # a plan must never stop training
        return None


def resolve_kernels(kernels: str, arch: ModelArch) -> None:
    """The kernel choice of the model this process is about to build (ops.select; with ``kernels: auto``
    on a CPU the choice recorded for its shapes, or a timing that records it: ops/choice.py), resolved
    before its memory plan reads it and before the trainer's memory meter starts, so that the timing's
    tensors (48.6 MiB on the h256 calibration shape), freed before the model is built, are not counted as
    training memory; the freed pages go back to the OS. The model's own select() then finds it resolved."""
    from bmtrain_cli.ops import OpShapes, select
    from bmtrain_cli.plan import host_memory

    if select(kernels, shapes=OpShapes.of(arch)).timings:
        host_memory.trim()


def memory_warning(est: Optional[MemoryEstimate]) -> Optional[str]:
    """A one-paragraph warning when the estimated peak exceeds the device's memory, else None."""
    if est is None or est.fits:
        return None
    return (
        f"warning: the memory plan estimates {format_bytes(est.required)} per device, more than the "
        f"{format_bytes(est.device.memory_bytes)} of {est.device.name}; training may run out of memory. "
        "Run `bmtrain plan --config ... --search` for a layout that fits (recompute, sharding, offload, LoRA)."
    )


def check_memory_fits(est: Optional[MemoryEstimate], allow_overcommit: bool) -> Optional[str]:
    """Refuse, before anything is allocated, a run whose memory plan exceeds the device's (or, on a CPU,
    the host's) memory, unless ``train_config.allow_memory_overcommit`` is set: then the warning to print.
    None when it fits or there is no plan."""
    from bmtrain_cli.errors import UserError

    if est is None or est.fits:
        return None
    if allow_overcommit:
        return memory_warning(est)
    raise UserError(
        f"the memory plan estimates {format_bytes(est.required)} per device, more than the "
        f"{format_bytes(est.device.memory_bytes)} of {est.device.name}: refused before allocating; run "
        "`bmtrain plan --config ... --search` for a layout that fits (recompute, sharding, offload, LoRA), "
        "or set train_config.allow_memory_overcommit: true to start anyway"
    )


def weights_exceed_device(est: MemoryEstimate) -> bool:
    """The weights alone (not an estimate: their exact size; with stage dpo's frozen reference copy) are
    larger than the device's memory."""
    return est.parameters + est.reference_weights > est.device.memory_bytes


def check_weights_fit(est: Optional[MemoryEstimate]) -> None:
    """Refuse, before anything is allocated, a model whose weights alone exceed the device's memory
    (building it would end in a MemoryError or the kernel's out-of-memory kill)."""
    if est is not None and weights_exceed_device(est):
        refuse_weights(
            est.parameters + est.reference_weights,
            est.device,
            " (with the frozen reference copy of stage dpo)" if est.reference_weights else "",
            f" (the memory plan estimates {format_bytes(est.required)} in all)",
        )


def refuse_weights(weight_bytes: int, device: Device, why: str = "", plan: str = "") -> None:
    """The one refusal of weights that cannot fit (train's plan, generate's and eval's model)."""
    from bmtrain_cli.errors import UserError

    raise UserError(
        f"the model's weights alone need {format_bytes(weight_bytes)} per device{why}, more than the "
        f"{format_bytes(device.memory_bytes)} of {device.name}{plan}; use a smaller model or more devices "
        "(`bmtrain plan --config ... --search`)"
    )


def check_arch_fits(arch: Any, bytes_per_param: int = 4, device: Optional[Device] = None) -> None:
    """Refuse a model to load for inference (`generate`, `eval`) whose weights alone exceed this machine's
    memory, by the same rule as train: e.g. a config.json with vocab_size 1e12. Does not import Paddle
    when ``device`` is given."""
    from bmtrain_cli.models.param_count import count_parameters
    from bmtrain_cli.plan.devices import detect_device

    dev = device if device is not None else detect_device()
    need = count_parameters(arch) * bytes_per_param
    if dev.memory_bytes and need > dev.memory_bytes:
        refuse_weights(need, dev, f" ({arch.vocab_size} vocabulary, {arch.num_hidden_layers} layers)")


def default_device(config: Any) -> Device:
    """The device a plan assumes when none is named: a GPU (A100-80GB) for multi-device or mixed-precision
    configs or a GPU build of Paddle, else this machine's CPU. Does not import Paddle."""
    from bmtrain_cli.machine import paddle_has_gpu
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
