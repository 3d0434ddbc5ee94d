"""The routed SwiGLU experts of an MoE layer over rows sorted by expert (models/moe.py): expert e takes the
``counts[e]`` rows after those of the experts before it and returns ``(silu(x gate_e) * x up_e) down_e``
for each, weights in Paddle's [in, out] layout. Three implementations, chosen by :func:`choose`:

* ``grouped``: one grouped GEMM on a CPU (kernels/cpu/moe_cpu.cc through the operators of
  kernels/paddle/moe_op.cc), fp32: every expert's gate/up, SwiGLU and down in one call, forward and
  backward (the rows' and every expert's weight gradients), OpenMP over (expert, tile) blocks, MKL's sgemm
  inside. It keeps the gate/up pre-activations [rows, 2f] for the backward, less than the reference.
* ``grouped_cuda``: on a GPU, our CUDA grouped GEMM (kernels/cuda/moe_cuda.cu through the operators of
  kernels/paddle/grouped_gemm_op.cc), fp32/fp16/bf16 with fp32 accumulation: one launch per projection
  for every expert (gate, up, down; in the backward each one's input and weight gradients), the SwiGLU
  between them in Paddle ops. Paddle 3.x has no grouped-GEMM op that trains (docs/kernels.md), so this is
  the GPU path, taken when the launcher passes a one-shot launch check against the reference.
* ``reference``: a Python loop over the experts with Paddle's matmuls (any device and dtype).

An expert without rows gets zero gradients in all three (not missing ones), so every data-parallel rank
reduces the same gradients and the optimizer sees them all.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import paddle
import paddle.nn.functional as F
from paddle.autograd import PyLayer

from bmtrain_cli.errors import NoticeWarning
from bmtrain_cli.ops.build import load_extension
from bmtrain_cli.ops.custom import contiguous

Weights = Tuple[Sequence[paddle.Tensor], Sequence[paddle.Tensor], Sequence[paddle.Tensor]]


def reference_experts(
    rows: paddle.Tensor, counts: Sequence[int], experts: Sequence[Callable[[paddle.Tensor], paddle.Tensor]]
) -> paddle.Tensor:
    """Expert by expert: ``experts[e]`` (a layer, or :func:`swiglu_expert`) over its rows, in Paddle ops
    (an expert without rows runs on zero rows: zero gradients)."""
    outs: List[paddle.Tensor] = []
    start = 0
    for e, n in enumerate(counts):
        outs.append(experts[e](rows[start : start + n]))
        start += n
    return paddle.concat(outs)


def swiglu_expert(
    gate: paddle.Tensor, up: paddle.Tensor, down: paddle.Tensor
) -> Callable[[paddle.Tensor], paddle.Tensor]:
    """One expert's ``(silu(x gate) * x up) down`` in Paddle ops, for :func:`reference_experts`."""
    return lambda x: paddle.matmul(F.silu(paddle.matmul(x, gate)) * paddle.matmul(x, up), down)


class _Grouped(PyLayer):
    @staticmethod
    def forward(ctx: Any, rows: paddle.Tensor, counts: List[int], *weights: paddle.Tensor) -> paddle.Tensor:
        e = len(counts)
        gate, up, down = list(weights[:e]), list(weights[e : 2 * e]), list(weights[2 * e :])
        y, gate_up = load_extension().bmt_moe_swiglu_fwd(rows, gate, up, down, counts)
        ctx.save_for_backward(rows, gate_up, *weights)
        ctx.counts = counts
        return y

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: None for the inputs that need no gradient
        ctx: Any, dy: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        rows, gate_up, *weights = ctx.saved_tensor()
        e = len(ctx.counts)
        gate, up, down = weights[:e], weights[e : 2 * e], weights[2 * e :]
        ext, dy = load_extension(), contiguous(dy)
        if all(w.stop_gradient for w in weights):  # frozen experts: the input gradient only
            return (
                ext.bmt_moe_swiglu_dx(rows, gate, up, down, gate_up, dy, ctx.counts),
                *[None] * len(weights),
            )
        dw = [paddle.empty(w.shape, w.dtype) for w in weights]
        out = ext.bmt_moe_swiglu_bwd(
            rows, gate, up, down, gate_up, dy, dw[:e], dw[e : 2 * e], dw[2 * e :], ctx.counts
        )
        dx = out[0] if isinstance(out, (list, tuple)) else out
        # Paddle wants None for an input that needs no gradient
        return (
            None if rows.stop_gradient else dx,
            *(None if w.stop_gradient else g for w, g in zip(weights, dw)),
        )


def _check(rows: paddle.Tensor, counts: Sequence[int], weights: Weights, cuda: bool) -> None:
    """A ValueError unless the grouped GEMM takes these arguments: on a CPU (``cuda`` False) float32 only,
    on a GPU one of :func:`takes`' dtypes throughout; a count per expert, summing to the rows."""
    gate, up, down = weights
    dtypes = {rows.dtype, *(w.dtype for w in (*gate, *up, *down))}
    got = sorted(str(d).replace("paddle.", "") for d in dtypes)
    if len(got) != 1 or got[0] not in _dtypes(cuda) or rows.place.is_cpu_place() == cuda:
        raise ValueError(
            f"moe experts: the {'CUDA' if cuda else 'CPU'} grouped GEMM takes one dtype of "
            f"{'/'.join(_dtypes(cuda))} on {'a GPU' if cuda else 'a CPU'}, got {', '.join(got)} on {rows.place}"
        )
    if not len(counts) == len(gate) == len(up) == len(down):
        raise ValueError(f"moe experts: {len(counts)} counts for {len(gate)}/{len(up)}/{len(down)} weights")
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"moe experts: the counts sum to {sum(counts)}, the rows are {rows.shape[0]}")


def grouped_experts(rows: paddle.Tensor, counts: Sequence[int], weights: Weights) -> paddle.Tensor:
    """Our CPU grouped GEMM (float32 on a CPU; a ValueError otherwise)."""
    _check(rows, counts, weights, cuda=False)
    gate, up, down = weights
    rows, flat = contiguous(rows), [contiguous(w) for w in (*gate, *up, *down)]
    needs_grad = not rows.stop_gradient or any(not w.stop_gradient for w in flat)
    if paddle.is_grad_enabled() and needs_grad:
        return _Grouped.apply(rows, [int(n) for n in counts], *flat)
    return load_extension().bmt_moe_swiglu_fwd(
        rows, list(gate), list(up), list(down), [int(n) for n in counts]
    )[0]


class _GroupedLinear(PyLayer):
    """One projection of every expert on a GPU: ``rows`` [r, k] sorted by expert times each expert's
    [k, n] weight, through our CUDA grouped GEMM; backward: the rows' and every weight's gradient."""

    @staticmethod
    def forward(ctx: Any, rows: paddle.Tensor, counts: List[int], *weights: paddle.Tensor) -> paddle.Tensor:
        ctx.save_for_backward(rows, *weights)
        ctx.counts = counts
        return load_extension().bmt_grouped_gemm(rows, list(weights), counts, False)

    @staticmethod
    def backward(  # type: ignore[override]  # PyLayer: None for the inputs that need no gradient
        ctx: Any, dy: paddle.Tensor
    ) -> Tuple[Optional[paddle.Tensor], ...]:
        rows, *weights = ctx.saved_tensor()
        ext, dy = load_extension(), contiguous(dy)
        dx = None if rows.stop_gradient else ext.bmt_grouped_gemm_dx(dy, weights, ctx.counts, False)
        if all(w.stop_gradient for w in weights):  # frozen experts: the input gradient only
            return (dx, *[None] * len(weights))
        dw = [paddle.empty(w.shape, w.dtype) for w in weights]
        ext.bmt_grouped_gemm_dw(rows, dy, dw, ctx.counts, False)
        return (dx, *(None if w.stop_gradient else g for w, g in zip(weights, dw)))


def cuda_grouped_experts(rows: paddle.Tensor, counts: Sequence[int], weights: Weights) -> paddle.Tensor:
    """Our CUDA grouped GEMM: ``(silu(x gate_e) * x up_e) down_e`` for every expert's rows, three grouped
    launches (fp32/fp16/bf16 on a GPU, one dtype throughout; a ValueError otherwise)."""
    _check(rows, counts, weights, cuda=True)
    gate, up, down = weights
    n = [int(c) for c in counts]

    def project(x: paddle.Tensor, ws: Sequence[paddle.Tensor]) -> paddle.Tensor:
        return _GroupedLinear.apply(contiguous(x), n, *[contiguous(w) for w in ws])

    return project(F.silu(project(rows, gate)) * project(rows, up), down)


# the launch check's rows per expert: an expert without rows and uneven ones
CHECK_COUNTS = (3, 0, 2)


def launch_check_pair() -> Tuple[Callable, Callable]:
    """(ours, reference) over ``(rows, *gate, *up, *down)`` with CHECK_COUNTS, for ops/launch_check.py."""
    e = len(CHECK_COUNTS)

    def ours(x: paddle.Tensor, *w: paddle.Tensor) -> paddle.Tensor:
        return cuda_grouped_experts(x, CHECK_COUNTS, (w[:e], w[e : 2 * e], w[2 * e :]))

    def ref(x: paddle.Tensor, *w: paddle.Tensor) -> paddle.Tensor:
        return reference_experts(
            x, CHECK_COUNTS, [swiglu_expert(*t) for t in zip(w[:e], w[e : 2 * e], w[2 * e :])]
        )

    return ours, ref


def launch_check_inputs() -> Tuple[paddle.Tensor, ...]:
    """The launch check's inputs: fp32 rows [sum(CHECK_COUNTS), 8] and each expert's gate, up [8, 4] and
    down [4, 8] on the current device, seeded."""
    paddle.seed(0)
    e, h, f = len(CHECK_COUNTS), 8, 4
    shapes = [[h, f]] * (2 * e) + [[f, h]] * e
    return (paddle.randn([sum(CHECK_COUNTS), h]), *[paddle.randn(s) * 0.5 for s in shapes])


_told: Set[str] = set()
_why: Dict[Tuple[str, str], str] = {}  # (mode, device) -> why the experts run what they run
_checked: Dict[str, Optional[str]] = {}  # device -> None (our CUDA grouped GEMM passed) or why it failed


def choose(mode: str, device: str, ours_built: bool) -> Tuple[str, str]:
    """(implementation, why) for ``model_config.kernels`` on ``device``; ``ours_built``: whether our
    extension loaded (on a GPU: with its CUDA part). Our grouped GEMM wherever our kernels run (``custom``,
    ``auto`` with the extension built): the CPU one on a CPU, the CUDA one on a GPU. Elsewhere the
    reference: Paddle 3.x has no grouped-GEMM MoE op that trains (``fused_moe`` and ``moe_ffn`` are
    forward-only inference ops, ``batched_gemm`` has no backward)."""
    if mode == "reference":
        return "reference", "kernels: reference"
    ours = mode in ("custom", "auto") and ours_built
    if device.startswith("cpu"):
        if ours:
            return "grouped", "our CPU grouped GEMM (kernels/cpu/moe_cpu.cc)"
        return "reference", f"kernels: {mode} without our CPU kernels"
    if ours:
        return "grouped_cuda", "our CUDA grouped GEMM (kernels/cuda/moe_cuda.cu)"
    return "reference", (
        f"kernels: {mode} on {device} without our CUDA kernels, and Paddle has no grouped-GEMM MoE op that "
        "trains (its fused_moe is inference-only): the experts run one matmul chain each"
    )


def takes(grouped: Callable, dtype: Any) -> bool:
    """Whether the grouped implementation ``grouped`` runs rows of ``dtype`` (weights of the same dtype)."""
    return str(dtype).replace("paddle.", "") in _dtypes(grouped is cuda_grouped_experts)


def _dtypes(cuda: bool) -> Tuple[str, ...]:
    """Our CPU GEMM takes float32, the CUDA one float32, float16 and bfloat16."""
    return ("float32", "float16", "bfloat16") if cuda else ("float32",)


def for_device(
    mode: str, device: str, ours_built: bool, check: Optional[Callable] = None
) -> Optional[Callable]:
    """``OpSet.moe_experts`` for ``mode`` on ``device``: our grouped GEMM, or None (the reference
    composition). On a GPU ours only after it passed ``check`` (default: ops/launch_check.run_check,
    once per device), else the reason is kept for :func:`resolve`'s warning."""
    impl, why = choose(mode, device, ours_built)
    if impl == "grouped_cuda":
        if device not in _checked:
            _checked[device] = _launch_check(check)
        failed = _checked[device]
        if failed is not None:
            impl, why = (
                "reference",
                (
                    f"our CUDA grouped GEMM failed its launch check on {device} ({failed}): the experts run "
                    "one matmul chain each"
                ),
            )
    _why[(mode, device)] = why
    return {"grouped": grouped_experts, "grouped_cuda": cuda_grouped_experts}.get(impl)


def _launch_check(check: Optional[Callable]) -> Optional[str]:
    from bmtrain_cli.ops.launch_check import launch_checked, run_check

    ours, ref = launch_check_pair()
    run = check or (lambda name, a, b: run_check(name, a, b, inputs=launch_check_inputs))
    failed = launch_checked({"moe_experts": ours}, {"moe_experts": ref}, run)[1]
    return failed.get("moe_experts")


def resolve(grouped: Optional[Callable], mode: str, device: str) -> Optional[Callable]:
    """What an MoE layer runs its experts with: ``grouped`` (``OpSet.moe_experts``) where set, else None
    (the reference composition); says once per process and reason when a GPU runs the reference."""
    if grouped is not None:
        return grouped
    why = _why.get((mode, device)) or choose(mode, device, ours_built=False)[1]
    if not device.startswith("cpu") and why not in _told:
        _told.add(why)
        warnings.warn(f"MoE experts: {why}", NoticeWarning, stacklevel=3)
    return None
