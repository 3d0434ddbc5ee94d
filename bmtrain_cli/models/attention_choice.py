"""Which attention kernel runs, and why (no Paddle import: the memory planner uses it too).

The kernels themselves live in models/attention.py. What the core receives decides the mask kind:
``causal`` (no mask: right-padded or unpadded rows), ``segments`` (segment ids of packed rows or
left-padded prompts) or ``bias`` (an additive mask: KV-cache decoding, a sliding window that bites,
ALiBi).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

IMPLEMENTATIONS = ("auto", "sdpa", "flash", "eager")
KERNELS = (
    "flash",
    "flash_varlen",
    "cpu_fused",
    "blocked",
    "grouped_mask",
    "sdpa_causal",
    "sdpa_mask",
    "eager",
)
# kernels whose memory is linear in the sequence length (no s x s tensor is kept or materialised)
LINEAR_KERNELS = ("flash", "flash_varlen", "cpu_fused", "blocked")
# Queries per block of the blocked kernel: its transient score blocks are [b, heads, BLOCK, s].
ATTENTION_BLOCK = 128
# query and key tokens per block of context parallel's ring attention (parallel/ring_attention.py): a
# block pair's scores [b, kv_heads, rep * RING_BLOCK, RING_BLOCK] are its transient memory, whatever the
# sequence length
RING_BLOCK = 512
# On a CPU in fp32 without the fused CPU kernel (``cpu_fused``: the custom extension is not built, or
# ``model_config.kernels`` is paddle/reference), sequences up to this length run Paddle's sdpa (one matmul
# + softmax, keeping the [b, heads, s, s] probabilities) instead of the blocked kernel. The fused kernel
# is faster than both at every length measured (docs/benchmarks.md, "Attention core on a CPU"). Measured forward + backward of the core,
# 4096 tokens per call (benchmarks/bench_attention_core.py, 2 threads), sdpa's speed-up over blocked:
# heads 4/4: 1.93x / 1.78x / 1.23x at 128 / 256 / 512 tokens; heads 9/3 (grouped): 1.28x / 1.12x / 0.94x.
# Above it the blocked kernel keeps its memory linear in the sequence length.
DENSE_MAX_SEQ = 256


# Paddle's flash kernels need an Ampere or newer GPU; above this head size flash_attention quietly takes
# the memory-efficient kernel, which ignores ``causal`` (nn/functional/flash_attention._select_sdp_cuda)
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256


def flash_refusal(
    capability: Optional[Tuple[int, int]],
    head_dim: Optional[int],
    fa_version: int = 2,
    training: bool = True,
    varlen: bool = False,
) -> Optional[str]:
    """Why Paddle's flash kernel cannot take this call on a GPU in half precision (None: it can).
    ``capability`` None and ``head_dim`` None mean unknown (the memory planner): taken as fit.
    ``fa_version`` is FLAGS_flash_attn_version: FA3's flash_attention asserts on ``training=False``
    (evaluation, generation, the DPO reference), which flash_attn_unpadded (always FA2) does not."""
    if capability is not None and tuple(capability) < FLASH_MIN_CAPABILITY:
        return f"compute capability {capability[0]}.{capability[1]} < 8.0 has no flash attention"
    if head_dim is not None and head_dim > FLASH_MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {FLASH_MAX_HEAD_DIM}: Paddle's flash_attention would drop causal"
    if fa_version == 3 and not training and not varlen:
        return "FLAGS_flash_attn_version=3 refuses training=False"
    return None


@dataclass(frozen=True)
class ScoreRule:
    """What a layer's attention scores obey beyond causality and segments: its sliding ``window`` (keys
    ``window`` or more positions before a query are not visible, on the tokens' places in the whole rows;
    None: every earlier key) and their soft ``softcap`` (the scaled scores become cap * tanh(s / cap) before
    the mask, Gemma 2's attn_logit_softcapping; None: uncapped)."""

    window: Optional[int] = None
    softcap: Optional[float] = None

    def within(self, rows: int) -> ScoreRule:
        """This rule over rows of ``rows`` tokens: a window as long as the rows holds every earlier key."""
        if self.window is not None and self.window >= rows:
            return ScoreRule(None, self.softcap)
        return self


def ring_pair_kernel(
    dtype: str,
    on_gpu: bool,
    packed: bool,
    fused_cpu: bool,
    capability: Optional[Tuple[int, int]] = None,
    head_dim: Optional[int] = None,
    rule: ScoreRule = ScoreRule(),
) -> Tuple[Optional[str], str]:
    """(kernel, why) for the chunk pairs of context parallel's ring attention (parallel/ring_pairs.py):
    ``flash`` (Paddle's flash attention on a GPU, fp16/bf16 rows without segment ids, a sliding window or
    soft-capped scores, where :func:`flash_refusal` lets it), ``cpu_fused`` (our fused CPU kernel,
    float32/float64, where the model's op set carries it; it applies the window and the soft cap itself), or
    None with the reason the blocks of Paddle ops run. ``dtype`` is the rows' dtype name (``float32``,
    ``bfloat16``, ...); ``rule``: the layer's :class:`ScoreRule` over the whole rows (its window shorter than
    the rows, :meth:`ScoreRule.within`). The run passes its rows' facts, the memory planner the configured
    ones (``capability`` and ``head_dim`` None: unknown, taken as fit)."""
    if on_gpu:
        if rule.softcap is not None:
            return None, "soft-capped scores: Paddle's flash attention takes no cap"
        if packed:
            return None, "packed rows: flash attention takes no segment ids"
        if rule.window is not None:
            return None, "a sliding window: Paddle's flash_attn (FA2) takes no window"
        if dtype not in ("float16", "bfloat16"):
            return None, f"{dtype}: flash attention takes fp16/bf16"
        refusal = flash_refusal(capability, head_dim)
        return (None, refusal) if refusal else ("flash", "Paddle's flash attention per chunk pair")
    if not fused_cpu:
        return None, "kernels: reference, or our kernels are not built"
    if dtype not in ("float32", "float64"):
        return None, f"{dtype}: the fused CPU kernel takes float32/float64"
    return "cpu_fused", "the fused CPU attention kernel per chunk pair"


def choose_kernel(
    kind: str,
    implementation: str,
    half: bool,
    on_gpu: bool,
    static: bool = False,
    seq_len: Optional[int] = None,
    fused_cpu: bool = False,
    capability: Optional[Tuple[int, int]] = None,
    head_dim: Optional[int] = None,
    fa_version: int = 2,
    training: bool = True,
    softcap: bool = False,
) -> Tuple[str, str]:
    """(kernel, why) for a mask kind, the configured ``attention_implementation``, the compute dtype
    (half: fp16/bf16), the device, whether a static graph with unknown sizes is being built, the
    sequence length (None: unknown, taken as long) and whether the fused CPU kernel is available (the
    model's op set carries it: our kernels built, ``kernels`` custom or auto). On a GPU, the compute
    ``capability``, the ``head_dim``, FLAGS_flash_attn_version and whether the call trains decide whether
    a flash kernel may run (:func:`flash_refusal`); where none may, and in fp32, Paddle's sdpa runs (one
    kernel on a GPU: its own flash / memory-efficient / math choice). The model passes the length of the
    batch it attends over and the memory planner the configured ``max_seq_len``, the longest a batch gets.
    Soft-capped scores (``softcap``, Gemma 2) have no fused, flash or sdpa kernel: the blocked kernel (any
    device, linear memory) takes them, or the eager reference where a bias or a static graph is given."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown attention implementation {implementation!r} (choose from {IMPLEMENTATIONS})"
        )
    if implementation == "eager":
        return "eager", "attention_implementation: eager (matmul + softmax reference with an additive mask)"
    if softcap:
        return _softcapped(kind, static)
    if kind == "bias":
        if not on_gpu and not static and implementation != "sdpa":
            why = "an additive mask on a CPU (KV cache, sliding window or ALiBi): grouped matmul + softmax"
            return "grouped_mask", why
        return "sdpa_mask", "an additive mask is needed (KV cache, sliding window or ALiBi)"
    if implementation == "sdpa":
        return _sdpa(kind, "attention_implementation: sdpa")
    if on_gpu:
        return _gpu_kernel(kind, half, static, capability, head_dim, fa_version, training)
    if static:
        # the blocked kernel loops over query blocks, by sizes a graph of unknown length does not have
        return _sdpa(kind, "static graph of unknown length: Paddle's sdpa")
    rows = "right-padded rows need no mask" if kind == "causal" else "segment ids masked block by block"
    if fused_cpu and not half:
        return "cpu_fused", f"CPU: fused C++ attention kernel, memory linear in the sequence length; {rows}"
    if not half and seq_len is not None and seq_len <= DENSE_MAX_SEQ:
        return _sdpa(
            kind,
            f"CPU, {seq_len} <= {DENSE_MAX_SEQ} tokens: matmul + softmax is faster than the blocked kernel",
        )
    return "blocked", f"CPU: exact blocked attention, memory linear in the sequence length; {rows}"


def _softcapped(kind: str, static: bool) -> Tuple[str, str]:
    none = "soft-capped scores: no fused CPU, flash or sdpa kernel caps them"
    if kind == "bias" or static:
        given = "an additive mask (KV cache)" if kind == "bias" else "a static graph of unknown length"
        return "eager", f"{none}; with {given}: the matmul + softmax reference"
    return "blocked", f"{none}; exact blocked attention in Paddle ops, memory linear in the sequence length"


def _sdpa(kind: str, why: str) -> Tuple[str, str]:
    if kind == "causal":
        return "sdpa_causal", f"{why}; right-padded rows need no mask"
    return "sdpa_mask", f"{why}; segment ids become an additive [b, 1, s, s] mask"


def _gpu_kernel(
    kind: str,
    half: bool,
    static: bool,
    capability: Optional[Tuple[int, int]],
    head_dim: Optional[int],
    fa_version: int,
    training: bool,
) -> Tuple[str, str]:
    if not half:
        return _sdpa(kind, "GPU fp32: Paddle's scaled_dot_product_attention (one kernel)")
    varlen = kind != "causal"
    refusal = flash_refusal(capability, head_dim, fa_version, training, varlen)
    if refusal is not None:
        return _sdpa(kind, f"GPU half precision, {refusal}: Paddle's sdpa")
    if kind == "causal":
        return "flash", "GPU half precision; right-padded rows need no mask"
    if static:
        # the variable-length kernel lays the rows end to end, by sizes a graph of unknown length lacks
        return _sdpa(kind, "static graph of unknown length: Paddle's sdpa")
    return "flash_varlen", "GPU half precision; packed rows as variable-length sequences (cu_seqlens)"


def training_mask_kind(arch: Any, seq_len: int, packed: bool, pipeline: bool = False) -> str:
    """The mask kind training batches reach the attention with: ``bias`` for ALiBi or a sliding window
    shorter than the sequence (unless the scores are soft-capped: the blocked kernel applies the window
    itself), ``segments`` for packed rows (and under pipeline parallelism, whose stages always pass the
    segment ids on), else ``causal`` (right-padded rows go without a mask)."""
    window = getattr(arch, "sliding_window", None)
    if getattr(arch, "attn_logit_softcapping", None) is not None:
        window = None
    if getattr(arch, "position_embedding", "rope") == "alibi" or (window is not None and seq_len > window):
        return "bias"
    return "segments" if (packed or pipeline) else "causal"
