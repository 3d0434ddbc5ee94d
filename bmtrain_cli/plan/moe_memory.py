"""The mixture-of-experts terms of the memory estimate (plan/activations.py): a sparse layer's MLP is the
router, every routed expert and the shared experts (weights), and per token the router's scores, the k
dispatched rows, the experts' kept pre-activations and weighted outputs (activations); the dispatch
buffers (the rows, the expert outputs and their gradients, the pre-activations' gradients) make the MLP's
backward working set. Dense and sparse layers differ: each term is the mean over the decoder's layers.
Under tensor parallel the router and the routed experts are whole on every rank (models/moe.py)."""

from __future__ import annotations

from typing import Any

from bmtrain_cli.models.arch import ModelArch, lora_parameters_per_layer
from bmtrain_cli.models.param_count import moe_parameters, sparse_layers

MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _mean(arch: ModelArch, dense: float, sparse: float) -> float:
    n = sparse_layers(arch)
    return ((arch.num_hidden_layers - n) * dense + n * sparse) / arch.num_hidden_layers


def mlp_params(arch: ModelArch, tp: int, ep: int = 1) -> int:
    """Matrix elements of one layer's MLP on one device (the mean over the layers); under expert parallel
    ``ep`` a rank holds 1/ep of the routed experts and the router whole, under tensor parallel ``tp``
    1/tp of the shared experts (the routed ones whole)."""
    dense = 3 * arch.hidden_size * arch.intermediate_size // tp
    if not arch.num_experts:
        return dense
    routed = arch.num_experts * 3 * arch.hidden_size * arch.moe_intermediate_size
    shared = 3 * arch.hidden_size * arch.moe_intermediate_size * arch.moe_shared_experts
    return int(_mean(arch, dense, moe_parameters(arch) - routed - shared + routed // ep + shared // tp))


def unheld_experts(arch: ModelArch, tp: int, ep: int, layers: int) -> int:
    """Matrix elements of the routed experts of ``layers`` layers that a rank does not hold under expert
    parallel ``ep``: what a frozen reference copy holding every expert adds to the rank's share (stage dpo's,
    which runs without dispatch; GRPO's has its experts split as the policy's)."""
    return layers * (mlp_params(arch, tp) - mlp_params(arch, tp, ep))


def all_to_all_bytes(arch: ModelArch, tokens: int, elem_bytes: int) -> int:
    """Expert parallel: the rows one sparse layer's all-to-all holds in flight, sent and received (the k
    routed copies of each token's hidden state, parallel/expert_parallel.py)."""
    return 2 * tokens * arch.num_experts_per_tok * arch.hidden_size * elem_bytes


def mlp_kept_elems(arch: ModelArch, grouped: bool, tp: int) -> float:
    """Elements per token one layer's MLP keeps for its backward (the mean over the layers). A sparse
    layer: the router's logits and probabilities (fp32), the routing indices and weights; per routed
    (token, expert) pair the gathered row and the expert's weighted output (hidden size each) and its
    gate/up pre-activations (the grouped GEMM keeps those alone; the per-expert composition its SwiGLU
    output too); the shared experts as a dense MLP."""
    dense = 3 * arch.intermediate_size / tp
    if not arch.num_experts:
        return dense
    k, f, h = arch.num_experts_per_tok, arch.moe_intermediate_size, arch.hidden_size
    router = 2 * arch.num_experts + 6 * k
    pairs = k * (2 * h + (2 if grouped else 3) * f)
    return _mean(arch, dense, router + pairs + 3 * f * arch.moe_shared_experts)


def mlp_backward_elems(arch: ModelArch, tp: int) -> float:
    """Elements per token of the MLP's backward working set (the mean over the layers): a dense MLP's
    gradients of its largest tensors; a sparse layer's dispatch buffers, the gradients of the expert
    outputs and of the gathered rows and of the pre-activations of each routed pair."""
    dense = 1.5 * arch.intermediate_size / tp
    if not arch.num_experts:
        return dense
    k, f, h = arch.num_experts_per_tok, arch.moe_intermediate_size, arch.hidden_size
    return _mean(arch, dense, k * (2 * h + 2 * f) + 1.5 * f * arch.moe_shared_experts)


def lora_params(arch: ModelArch, rank: int, targets: Any, tp: int, ep: int = 1) -> int:
    """Adapter parameters of one layer (the mean over the layers): on a sparse layer every routed expert
    (under expert parallel ``ep`` the 1/ep a rank holds) and the shared experts carry their own adapters
    on the targeted MLP projections."""
    every = lora_parameters_per_layer(arch, rank, targets, tp)
    if not arch.num_experts:
        return every
    names = [targets] if isinstance(targets, str) else list(targets)
    mlp = [n for n in MLP_PROJECTIONS if n in names or "all-linear" in names]
    attention = lora_parameters_per_layer(arch, rank, [n for n in names if n not in (*mlp, "all-linear")], tp)
    if "all-linear" in names:
        attention = every - len(mlp) * rank * (arch.hidden_size + arch.intermediate_size)
    h, f = arch.hidden_size, arch.moe_intermediate_size
    shared = f * arch.moe_shared_experts
    experts = len(mlp) * rank * (arch.num_experts // ep * (h + f) + ((h + shared) if shared else 0))
    return int(_mean(arch, every, attention + experts))


def moe_note(arch: ModelArch, tokens: int, elem_bytes: int) -> str:
    """The plan's line on a mixture of experts: total and active parameters, the router's and the experts'
    share of a sparse layer, and the dispatch buffers of one micro-batch."""
    from bmtrain_cli.models.param_count import count_active_parameters, count_parameters
    from bmtrain_cli.plan.devices import format_bytes

    h, f, k, n = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts_per_tok, arch.num_experts
    dispatch = tokens * k * (2 * h + 2 * f) * elem_bytes
    return (
        f"mixture of experts: {count_parameters(arch):,} parameters, {count_active_parameters(arch):,} "
        f"active per token (top {k} of {n} experts); each of the {sparse_layers(arch)} sparse layers holds "
        f"a router of {h * n:,} and experts of {3 * h * f * n:,}; dispatch buffers "
        f"{format_bytes(dispatch)} per sparse layer and micro-batch ({k} routed rows per token, the "
        "expert outputs and their gradients)"
    )
