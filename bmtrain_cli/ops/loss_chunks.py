"""How many tokens one chunk of the fused LM-head loss takes (no Paddle import: the memory planner uses it).

Each chunk is one [tokens, hidden] x [hidden, vocab] GEMM, its fp32 logits and their gradient. A fixed
logits budget alone gives tiny GEMMs on large vocabularies (2^23 logits are 55 tokens of Qwen's 152k
vocabulary), which leave a GPU's tensor cores idle; a floor on the tokens keeps the GEMMs large while the
budget bounds the memory.
"""

from __future__ import annotations

# CPU: logits per chunk (fp32: 32 MiB; the figures in docs/benchmarks.md were measured with it)
CPU_CHUNK_ELEMENTS = 1 << 23
# GPU: logits per chunk (fp32: 512 MiB, their gradient as much again) and the fewest tokens a chunk takes
GPU_CHUNK_ELEMENTS = 1 << 27
GPU_MIN_CHUNK_TOKENS = 512
# an int8 LM head (quant/vocab.py): at most this many head weights dequantised at once (fp32: 32 MiB)
QUANT_HEAD_CHUNK_WEIGHTS = 1 << 23


def chunk_tokens(vocab: int, tokens: int, on_gpu: bool) -> int:
    """Tokens per chunk for ``tokens`` rows over a ``vocab``-sized head (at least 1, at most ``tokens``)."""
    vocab = max(int(vocab), 1)
    if on_gpu:
        step = max(GPU_MIN_CHUNK_TOKENS, GPU_CHUNK_ELEMENTS // vocab)
    else:
        step = max(1, CPU_CHUNK_ELEMENTS // vocab)
    return max(1, min(step, int(tokens))) if tokens > 0 else step
