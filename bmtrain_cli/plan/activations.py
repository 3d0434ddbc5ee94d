"""Per-device parameter counts and activation / loss bytes of one decoder layer and the loss, for the
memory estimator (plan/estimator.py): the tensors the code keeps, by attention kernel and recompute mode."""

from __future__ import annotations

from typing import List, Tuple

from bmtrain_cli.machine import find_cxx
from bmtrain_cli.models import attention_choice
from bmtrain_cli.models.arch import LORA_PROJECTIONS, ModelArch
from bmtrain_cli.models.attention_choice import ATTENTION_BLOCK, RING_BLOCK, choose_kernel, training_mask_kind
from bmtrain_cli.models.families import deepseek_v3 as mla
from bmtrain_cli.models.families._linear import LinearAttention
from bmtrain_cli.ops import choice
from bmtrain_cli.ops.loss_chunks import chunk_tokens
from bmtrain_cli.plan import moe_memory
from bmtrain_cli.plan.devices import Device
from bmtrain_cli.plan.workload import BLOCKED_TEMPORARIES, RING_TEMPORARIES, Layout, Workload

# ----------------------------------------------------------------------------------------------
# parameter accounting


def expert_shapes(arch: ModelArch) -> List[Tuple[str, int, int]]:
    """(module name, in, out) of every expert projection of one sparse layer (models/moe.py), shared
    experts included; the router (``gate``) is not among them."""
    h, f = arch.hidden_size, arch.moe_intermediate_size
    out = []
    for prefix, width in [(f"mlp.experts.{e}", f) for e in range(arch.num_experts)] + (
        [("mlp.shared_experts", f * arch.moe_shared_experts)] if arch.moe_shared_experts else []
    ):
        out += [
            (f"{prefix}.gate_proj", h, width),
            (f"{prefix}.up_proj", h, width),
            (f"{prefix}.down_proj", width, h),
        ]
    return out


def layer_params(arch: ModelArch, tp: int, ep: int = 1) -> Tuple[int, int]:
    """(matrix elements per device, replicated vector elements) of one decoder layer; a mixture of
    experts' layers hold the mean over its dense and sparse layers' MLPs, 1/ep of the routed experts under
    expert parallel (plan/moe_memory.py)."""
    h, hd = arch.hidden_size, arch.head_dim
    if arch.kv_lora_rank:  # multi-head latent attention: tp splits the heads' projections, not the latent's
        shapes = {n: i * o for n, (i, o) in mla.mla_shapes(arch).items() if n in mla.mla_projections(arch)}
        attn = sum(
            e // (tp if n in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj") else 1) for n, e in shapes.items()
        )
        return attn + moe_memory.mlp_params(arch, tp, ep), mla.mla_parameters(arch) - sum(
            shapes.values()
        ) + 2 * h
    q = arch.num_attention_heads * hd
    kv = arch.num_key_value_heads * hd
    mixer = (h * (q * (2 if arch.attn_output_gate else 1) + 2 * kv) + q * h) // tp
    mats = mixer + moe_memory.mlp_params(arch, tp, ep)
    vecs = 2 * h
    if arch.attention_bias:
        mats += (q + 2 * kv) // tp
    if arch.qk_norm:
        vecs += 2 * hd
    if arch.linear_attention is not None:  # a hybrid (Qwen3.5): the mean of its layers' mixers per rank
        mlp = 3 * h * arch.intermediate_size // tp
        attention = mats - mlp + vecs - 2 * h  # projections, biases, q/k norms
        mats = LinearAttention.mixer_parameters(arch, attention, tp) // arch.num_hidden_layers + mlp
        vecs = 2 * h
    return mats, vecs


def quantized_layer(w: Workload, ep: int = 1) -> Tuple[int, int, int]:
    """(elements, bytes) of one decoder layer's projections that model_config.quantization stores
    low-bit (codes and scales, bmtrain_cli/quant/formats.py; a mixture of experts' experts too, under
    expert parallel ``ep`` the 1/ep of the routed experts a rank holds), the mean over the layers, and the
    elements of the largest of them; (0, 0, 0) without quantization."""
    if not w.quant_method:
        return 0, 0, 0
    from bmtrain_cli.models.arch import arch_projections, projection_shapes

    a = w.arch
    shapes = projection_shapes(a)
    mlp = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
    sparse = sum(a.is_sparse(i) for i in range(a.num_hidden_layers)) if a.num_experts else 0
    held = [  # (name, in, out, layers holding it)
        (n, *shapes[n], a.num_hidden_layers - sparse if n in mlp else a.num_hidden_layers)
        for n in arch_projections(a)
    ]
    others = tuple(f"mlp.experts.{e}." for e in range(a.num_experts // ep, a.num_experts))
    held += [
        (n, k, o, sparse) for n, k, o in (expert_shapes(a) if sparse else []) if not n.startswith(others)
    ]
    return _quantized_sum(w, held, a.num_hidden_layers)


def _quantized_sum(w: Workload, held: List[Tuple[str, int, int, int]], layers: int) -> Tuple[int, int, int]:
    from bmtrain_cli.quant.formats import quantized_nbytes
    from bmtrain_cli.quant.select import is_skipped

    elements = nbytes = largest = 0  # summed over the layers, then the mean of a layer
    for name, k, n, times in held:
        if times and not is_skipped(name, w.quant_skip):
            elements += times * k * n
            nbytes += times * quantized_nbytes(w.quant_method, n, k, w.quant_block or k, w.quant_double)
            largest = max(largest, k * n)
    return elements // layers, nbytes // layers, largest


def quantized_vocab(w: Workload) -> Tuple[int, int, int]:
    """(elements, bytes, workspace bytes) of the input embedding and LM head that model_config.quantization
    stores in int8 (bmtrain_cli/quant/vocab.py: codes and a scale per vocabulary row; a tied head is the
    embedding's codes) and the fp32 head rows the loss dequantises at once; zeros when both are skipped."""
    if not w.quant_method:
        return 0, 0, 0
    from bmtrain_cli.ops.loss_chunks import QUANT_HEAD_CHUNK_WEIGHTS
    from bmtrain_cli.quant.formats import quantized_nbytes
    from bmtrain_cli.quant.select import EMBED_NAME, HEAD_NAME, is_skipped

    a = w.arch
    names = [EMBED_NAME] if a.tie_word_embeddings else [EMBED_NAME, HEAD_NAME]
    held = [n for n in names if not is_skipped(f"model.{n}", w.quant_skip)]
    per = a.vocab_size * a.hidden_size
    head = (HEAD_NAME if len(names) > 1 else EMBED_NAME) in held
    workspace = min(per, QUANT_HEAD_CHUNK_WEIGHTS) * 4 if head else 0
    return (
        len(held) * per,
        len(held) * quantized_nbytes("int8", a.vocab_size, a.hidden_size, a.hidden_size),
        workspace,
    )


def dequantization_workspace(w: Workload, device: Device, largest: int, pbytes: int) -> int:
    """Bytes of dequantised weights a quantised layer holds while it multiplies (ops/quant_linear.py): on
    a CPU one tile of the C++ kernels (at most TILE_ELEMENTS fp32 weights); elsewhere the whole largest
    quantised projection in the compute dtype (dequantise-then-matmul, one layer at a time: nf4 on a GPU;
    an upper bound for int8/int4, whose weight_only_linear reads the codes directly)."""
    from bmtrain_cli.ops.quant_tiles import TILE_ELEMENTS

    if not w.quant_method:
        return 0
    return min(largest, TILE_ELEMENTS) * 4 if device.kind == "cpu" else largest * pbytes


def lora_layer_params(w: Workload, tp: int, ep: int = 1) -> int:
    return moe_memory.lora_params(w.arch, w.lora_rank, w.lora_targets, tp, ep)


def stage_layers(num_layers: int, pp: int) -> List[int]:
    """Decoder layers per pipeline stage (uniform partition: earlier stages take the remainder)."""
    base, extra = divmod(num_layers, pp)
    return [base + (1 if i < extra else 0) for i in range(pp)]


# ----------------------------------------------------------------------------------------------
# activations


def _custom_ops(device: Device) -> Tuple[str, ...]:
    """The ops our kernels provide where the run builds them: on a CPU with a C++ compiler; a GPU is
    assumed to build them."""
    return choice.OP_NAMES if device.kind != "cpu" or find_cxx() is not None else ()


def fused_cpu_attention(w: Workload, device: Device) -> bool:
    """Whether the model's op set carries the fused CPU attention core (ops.select): our kernels take part
    on a CPU, i.e. ``kernels`` custom, or auto with a C++ compiler to build them."""
    offered = choice.layers(w.kernels, device.kind, _custom_ops(device))
    return device.kind == "cpu" and any(src == "custom" for src, _ in offered)


def ring_pair_kernel(w: Workload, device: Device, cp: int = 1) -> bool:
    """Whether the ring attends each chunk pair with one kernel call (models/attention_choice.py
    ring_pair_kernel: the run's rule, given the configured precision, packing, head size and sliding
    window; ``w.seq_len`` is a rank's share of rows of ``cp`` shares, which a window shorter than the rows
    cuts: its layers take the blocks of Paddle ops on a GPU, the most any layer holds; soft-capped scores
    take them everywhere)."""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(w.precision, "float32")
    gpu, fused = device.kind != "cpu", fused_cpu_attention(w, device)
    rule = attention_choice.ScoreRule(
        getattr(w.arch, "sliding_window", None), getattr(w.arch, "attn_logit_softcapping", None)
    )
    name, _ = attention_choice.ring_pair_kernel(
        dtype, gpu, w.packed, fused, head_dim=w.arch.head_dim, rule=rule.within(w.seq_len * cp)
    )
    return name is not None


def attention_kernel(w: Workload, device: Device, layout: Layout) -> str:
    """The kernel training runs (models/attention_choice.py): a flash, fused CPU or blocked one keeps no
    score matrix; sdpa and eager on a CPU keep the softmax probabilities [b, heads, s, s] of every layer.
    Under context parallel every layer runs the ring (parallel/ring_attention.py), or in the ulysses mode
    (parallel/ulysses.py) the kernel one process runs, over whole rows of 1/cp of the heads."""
    if layout.cp > 1 and layout.cp_mode == "ring":
        return "ring"
    row = attention_row(w, layout)
    kind = training_mask_kind(w.arch, row, w.packed, layout.pp > 1)
    gpu = device.kind != "cpu"
    half = w.precision in ("bf16", "fp16")
    fused = fused_cpu_attention(w, device)
    softcap = getattr(w.arch, "attn_logit_softcapping", None) is not None
    return choose_kernel(kind, w.attention, half, gpu, seq_len=row, fused_cpu=fused, softcap=softcap)[0]


def attention_row(w: Workload, layout: Layout) -> int:
    """The row length the attention kernel sees: under the ulysses mode whole rows (the estimator's
    ``w.seq_len`` is then a rank's share), else ``w.seq_len``. Per token of the share, a kernel's
    per-head state over the keys is then heads / cp x cp x share = heads x row."""
    return w.seq_len * layout.cp if layout.cp_mode == "ulysses" else w.seq_len


def _keeps_scores(kernel: str, device: Device) -> bool:
    """Whether the attention keeps an s x s probability matrix per layer (Paddle's sdpa is its math
    composition on a CPU; on a GPU it picks a flash or memory-efficient kernel)."""
    return kernel == "eager" or (kernel.startswith("sdpa") and device.kind == "cpu")


def kernel_choice(w: Workload, device: Device, layout: Layout) -> choice.KernelChoice:
    """The implementation of each fused op the run takes: ops/choice.resolve, the function ops.select
    calls, with our kernels where they build (on a CPU: with a C++ compiler; a GPU is assumed to build
    them). ``auto`` on a CPU in one process reads the choice a run on this machine measured and recorded
    for the model's shapes; without a record it is the static order, marked ``unmeasured``."""
    shapes = choice.OpShapes.of(w.arch)
    return choice.resolve(w.kernels, device.kind, shapes, _custom_ops(device), layout.world_size)


def _unfused_elems(w: Workload, device: Device, layout: Layout) -> float:
    """Elements per token a layer keeps beyond the fused kernels' for the ops that run as compositions of
    Paddle ops (bmtrain_cli/ops/reference.py) in the resolved kernel choice: ``kernels: reference``
    everywhere; ``paddle`` (or ``auto`` without a compiler) on a CPU, which has Paddle's fused SwiGLU but
    not its RMSNorm or rotary kernels; ``auto`` where the recorded measurement took the reference."""
    a = w.arch
    tp = layout.tp
    sources = kernel_choice(w, device, layout).sources
    extra = 0.0
    if sources["rms_norm"] == "reference":  # each RMSNorm keeps its fp32 normalised input (weight's gradient)
        extra += 2 * a.hidden_size * 4 / act_bytes(w)
    if sources["rotary"] == "reference":  # the rotated-half copies of q and k
        extra += (a.num_attention_heads + a.num_key_value_heads) * a.head_dim / tp
    if sources["swiglu"] == "reference":  # silu(gate), kept for the product with up
        extra += a.intermediate_size / tp
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
    kernel = attention_kernel(w, device, layout)
    scores = _keeps_scores(kernel, device)
    # q, k, v as the attention core keeps them: the score-keeping compositions repeat K/V to the query
    # heads (eager and sdpa's math path); the flash, fused CPU and blocked kernels keep K/V with their own
    # heads (and the per-query log-sum-exp, below)
    core_in = (3 * q if (n_rep > 1 and scores) else q + 2 * kv) / tp
    attn_out = q / tp
    if layout.cp_mode == "ulysses":  # the kernel keeps its output beside the all-to-all's back to the share
        attn_out *= 2
    if a.kv_lora_rank:  # latent attention: the core's q, k, v at one width, and the latents before them
        core_in, attn_out = latent_attention_elems(a), a.num_attention_heads * a.v_head_dim
    # gate, up (SwiGLU inputs), SwiGLU output; a mixture of experts' router and dispatched rows
    mlp = moe_memory.mlp_kept_elems(a, fused_cpu_attention(w, device), tp)
    core = 0.0
    if mode == "none":
        if scores:
            core = heads * attention_row(w, layout)  # probabilities [b, heads, s, s] (per token: heads x s)
        else:
            core = heads  # log-sum-exp
    if a.qk_norm:
        core_in += (q + kv) / tp  # q/k before their norm
    core_in += _unfused_elems(w, device, layout)
    if w.finetuning == "lora":
        n_targets = len([t for t in w.lora_targets if t in LORA_PROJECTIONS])
        core_in += n_targets * w.lora_rank + (n_targets * h if w.lora_dropout > 0 else 0)
    kept = hidden_part + core_in + attn_out + mlp + core
    if a.linear_attention is not None and mode != "full":  # a hybrid: the mean over its layers
        linear = sum(a.layer_type(i) == "linear_attention" for i in range(a.num_hidden_layers))
        mean = linear / a.num_hidden_layers
        # tensor parallel splits its heads; our CPU kernel runs its delta rule where the fused attention runs
        linear_kept = a.linear_attention.activation_elements(fused_cpu_attention(w, device)) / tp
        kept = (1 - mean) * kept + mean * (hidden_part + linear_kept + mlp)
    return kept, float(hidden_part)


def latent_attention_elems(a: ModelArch) -> float:
    """Elements per token a latent-attention layer keeps for its backward before the output projection
    (models/blocks.py LatentAttention): q, k, v widened to one width for the core; q and k before the
    widening (and q before its scale); the latents (q_a_proj out and its norm, kv_a_proj_with_mqa out, its
    norm) and kv_b_proj's output. From the code, not calibrated against a measured run."""
    n, width = a.num_attention_heads, max(a.qk_nope_head_dim + a.head_dim, a.v_head_dim)
    qk = n * (a.qk_nope_head_dim + a.head_dim)
    latents = 2 * a.q_lora_rank + 2 * a.kv_lora_rank + a.head_dim
    return 3 * n * width + 3 * qk + latents + n * (a.qk_nope_head_dim + a.v_head_dim)


def act_bytes(w: Workload) -> int:
    return 2 if w.precision in ("bf16", "fp16") else 4


def layer_activations(
    w: Workload, device: Device, layout: Layout, layers: int, mode: str
) -> List[Tuple[int, int]]:
    """Per layer, first to last: (bytes kept after the forward of one micro-batch, working set of its
    backward). Recompute applies to the first ``recompute_layers`` layers (all when None); a recomputed
    layer's backward first rebuilds what it did not keep."""
    tokens = w.micro_sequences(layout) * w.seq_len
    e = act_bytes(w)
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
    work = (a.hidden_size + moe_memory.mlp_backward_elems(a, layout.tp)) * tokens * e
    kernel = attention_kernel(w, device, layout)
    heads = a.num_attention_heads / layout.tp
    mlp_freed = 3 * a.intermediate_size / layout.tp + 2 * a.hidden_size
    row = attention_row(w, layout)
    if _keeps_scores(kernel, device):
        work = max(work, (2 * heads * row - mlp_freed) * tokens * e)
    elif kernel == "blocked":
        q_el, kv_el = heads * a.head_dim, a.num_key_value_heads * a.head_dim / layout.tp
        per_token = (
            4 * q_el + 2 * kv_el * 4 / e + BLOCKED_TEMPORARIES * heads * min(ATTENTION_BLOCK, row) * 4 / e
        )
        work = max(work, (per_token - mlp_freed) * tokens * e)
    elif kernel == "ring":
        # its backward (parallel/ring_attention.py): copies of q and of the output's gradient, the query
        # gradients in fp32 and their cast, the stacked K/V with the block received from the ring, the
        # travelling fp32 K/V gradient accumulators with the pair received; then per chunk pair either one
        # kernel call's outputs and inputs (parallel/ring_pairs.py: a chunk's dq, the pair's dk, dv and its
        # K/V slots) or one block pair's fp32 temporaries [b, heads, block, block] of the Paddle-op blocks
        # (a fixed size, counted per token of the micro-batch)
        q_el, kv_el = heads * a.head_dim, a.num_key_value_heads * a.head_dim / layout.tp
        if ring_pair_kernel(w, device, layout.cp):
            pair = q_el / 2 + 2 * kv_el
        else:
            block = min(RING_BLOCK, w.seq_len // 2)
            pair = RING_TEMPORARIES * heads * block * block * w.micro_sequences(layout) / tokens * 4 / e
        per_token = (3 + 4 / e) * q_el + (4 + 4 * 4 / e) * kv_el + pair
        work = max(work, (per_token - mlp_freed) * tokens * e)
    elif kernel == "cpu_fused":
        # its gradients of q, k, v and the K/V gradient accumulators (kernels/cpu/attention_cpu.cc: one
        # pair per (batch, kv head), more when few pairs are split over threads); scratch is per thread
        q_el, kv_el = heads * a.head_dim, a.num_key_value_heads * a.head_dim / layout.tp
        work = max(work, (q_el + 4 * kv_el - mlp_freed) * tokens * e)
    out = []
    for i in range(layers):
        if i < n_rec:
            out.append((int(kept_rec * tokens * e), int(work + (full_layer - kept_rec) * tokens * e)))
        else:
            out.append((int(full_layer * tokens * e), int(work)))
    return out


def context_share(seq_len: int, cp: int) -> int:
    """Tokens of a row one rank of a context group holds: its front and back chunk of ceil(seq / 2cp)."""
    return -(-seq_len // (2 * cp)) * 2


def held_predictions(seq_len: int, completion: int, cp: int) -> int:
    """The most completion-predicting positions of a row of ``seq_len`` tokens (the ``completion`` positions
    before its last token) that one rank of a context group holds (parallel/ring_attention.local_indices:
    rank r holds chunks r and 2cp - 1 - r)."""
    if cp == 1:
        return completion
    c = -(-seq_len // (2 * cp))
    lo, hi = seq_len - 1 - completion, seq_len - 1

    def overlap(k: int) -> int:
        return max(0, min(hi, (k + 1) * c) - max(lo, k * c))

    return max(overlap(r) + overlap(2 * cp - 1 - r) for r in range(cp))


def no_grad_forward_bytes(w: Workload, device: Device, layout: Layout) -> int:
    """The most a forward without gradients (stage dpo's reference) holds at once inside one layer: the
    layer input with q, k, v and, for a score-keeping kernel, the scores beside their softmax [b, heads, s, s];
    or in the MLP, its input, gate, up, the activation and the product."""
    a = w.arch
    tokens = w.micro_sequences(layout) * w.seq_len
    heads = a.num_attention_heads / layout.tp
    qkv = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim / layout.tp
    row = attention_row(w, layout)
    scores = 2 * heads * row if _keeps_scores(attention_kernel(w, device, layout), device) else heads
    attention = a.hidden_size + qkv + scores
    mlp = a.hidden_size + 4 * a.intermediate_size / layout.tp
    return int(max(attention, mlp) * tokens * act_bytes(w))


def loss_bytes(w: Workload, device: Device, layout: Layout, last_stage: bool) -> Tuple[int, int]:
    """(bytes kept for the loss's backward, transient peak while computing it) on the last stage."""
    if not last_stage:
        return 0, 0
    a = w.arch
    seqs = w.micro_sequences(layout)
    n = seqs * (w.seq_len - 1)
    h, vocab = a.hidden_size, a.vocab_size // layout.tp
    e = act_bytes(w)
    head_elems = h * vocab
    final = h * seqs * w.seq_len * e  # final norm input
    if w.method.sample in ("pair", "completion"):
        # the pair loss (preference/logps.py) and GRPO's (grpo/objective.py) take the response or
        # completion positions' hidden states (gathered), their logits, an fp32 copy and the
        # cross-entropy's fp32 softmax; pairs counted as if every position were a response token, GRPO's
        # rows as max_completion_length completion tokens (upper bounds). Transient: the logits and the
        # fp32 copy before the softmax replaces them, then the logits' gradient in both dtypes; GRPO's
        # entropy (no gradient) holds three fp32 [tokens, vocab] tensors at once.
        if w.method.sample == "completion":  # under context parallel: the completion positions a share holds
            n = seqs * held_predictions(w.seq_len * layout.cp, w.completion_len, layout.cp)
        logits = n * vocab
        entropy = 3 * logits * 4 if w.method.sample == "completion" else 0
        return int(final + n * h * e + logits * 4), int(max(logits * (e + 4), entropy))
    if layout.tp == 1 and kernel_choice(w, device, layout).sources["linear_cross_entropy"] == "custom":
        # fused linear + cross-entropy in chunks (ops/custom.py, ops/loss_chunks.chunk_tokens): keeps
        # d(hidden) and d(weight) (the weight's accumulator is fp32 for fp32 weights, the compute dtype for
        # fp16/bf16); transient: a contiguous copy of the hidden states, a chunk's fp32 logits and their
        # gradient, and the chunk's weight-gradient part
        w_acc = 4 if e >= 4 else e
        kept = final + n * h * 4 + head_elems * w_acc
        chunk = chunk_tokens(vocab, n, device.kind != "cpu") * vocab
        transient = 2 * chunk * 4 + head_elems * w_acc + n * h * e
        if w.finetuning == "lora":
            kept -= head_elems * w_acc
            transient -= head_elems * w_acc
        return int(kept), int(transient)
    # materialised logits (vocab-parallel cross-entropy, or the reference linear + cross-entropy): logits,
    # fp32 softmax, and their gradient
    logits = n * vocab
    return int(final + logits * (e + 4)), int(logits * 4 * 2)
