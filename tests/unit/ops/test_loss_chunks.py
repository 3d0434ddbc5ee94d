"""Chunk sizes of the fused LM-head loss (ops/loss_chunks.py), shared by ops/custom.py and the planner."""

from __future__ import annotations

from bmtrain_cli.ops.custom import _chunks
from bmtrain_cli.ops.loss_chunks import (
    CPU_CHUNK_ELEMENTS,
    GPU_CHUNK_ELEMENTS,
    GPU_MIN_CHUNK_TOKENS,
    chunk_tokens,
)

QWEN_VOCAB = 151936


def test_qwen_vocabulary_on_a_gpu_keeps_large_gemms_and_bounded_memory():
    step = chunk_tokens(QWEN_VOCAB, 16384, on_gpu=True)
    assert step == GPU_CHUNK_ELEMENTS // QWEN_VOCAB == 883  # was 55 tokens with 2^23 logits
    assert step >= GPU_MIN_CHUNK_TOKENS
    assert step * QWEN_VOCAB * 4 <= 512 << 20  # a chunk's fp32 logits
    # a vocabulary so large that the budget alone would give tiny GEMMs: the floor wins
    assert chunk_tokens(1 << 20, 16384, on_gpu=True) == GPU_MIN_CHUNK_TOKENS
    # never more than the tokens there are
    assert chunk_tokens(QWEN_VOCAB, 100, on_gpu=True) == 100


def test_cpu_keeps_its_measured_budget():
    assert chunk_tokens(49152, 10_000, on_gpu=False) == CPU_CHUNK_ELEMENTS // 49152
    assert chunk_tokens(QWEN_VOCAB, 10_000, on_gpu=False) == 55
    assert chunk_tokens(1 << 30, 10, on_gpu=False) == 1


def test_the_op_walks_the_same_chunks():
    got = list(_chunks(2000, QWEN_VOCAB, None, on_gpu=True))
    assert got == [(0, 883), (883, 1766), (1766, 2000)]
    assert list(_chunks(7, 10, 3)) == [(0, 3), (3, 6), (6, 7)]  # an explicit chunk_tokens wins


def test_planner_counts_the_gpu_chunk():
    from bmtrain_cli.plan import activations

    assert activations.chunk_tokens is chunk_tokens
