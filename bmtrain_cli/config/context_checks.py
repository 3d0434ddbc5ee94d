"""validate-config checks of context parallel (parallel_config.context_parallel > 1): what the ring
attention of parallel/ring_attention.py and the all-to-all of parallel/ulysses.py run today. Each refusal
says why."""

from __future__ import annotations

from typing import Any, Callable, Optional


def check_context(config: Any, arch: Any, err: Callable[..., None]) -> None:
    p, m, t = config.parallel, config.model, config.train
    n = p.context_parallel
    if n == 1:
        return
    if m.max_seq_len % (2 * n):
        err(
            "model_config.max_seq_len",
            f"max_seq_len ({m.max_seq_len}) is not divisible by 2 x context_parallel ({2 * n}): each rank "
            "holds two equal chunks of every sequence (a front and a back one, so the causal work is even)",
            f"use max_seq_len {m.max_seq_len - m.max_seq_len % (2 * n) or 2 * n} or another degree",
        )
    if p.sharding_parallel > 1 and p.sharding_stage != 1:
        err(
            "parallel_config.sharding_stage",
            f"context parallel does not support sharding_stage {p.sharding_stage} yet: stage 2/3 run only on "
            "a GPU build of Paddle (group_sharded_parallel), where their reductions beside the context groups "
            "are not checked against one process (stage 1's are)",
            "use sharding_stage: 1",
        )
    if t.to_static:
        err("train_config.to_static", "to_static cannot run the ring's send/recv", "set to_static: false")
    _check_arch(arch, err)
    if p.context_parallel_mode == "ulysses" and arch is not None:
        _check_ulysses(arch, n, p.tensor_parallel, err)


def _check_ulysses(arch: Any, n: int, tp: int, err: Callable[..., None]) -> None:
    """The ulysses mode (parallel/ulysses.py) gives each rank of the group 1/N of a tensor rank's query and
    KV heads."""
    heads, kv = arch.num_attention_heads // tp, arch.num_key_value_heads // tp
    if kv % n:
        err(
            "parallel_config.context_parallel_mode",
            f"context_parallel_mode ulysses gives each of the {n} ranks of a context group 1/{n} of the KV "
            f"heads, but a rank holds {kv} ({arch.num_key_value_heads} KV heads / tensor_parallel {tp}) for "
            f"{heads} query heads: not divisible by context_parallel {n}",
            "use context_parallel_mode: ring (any number of heads) or a degree that divides the KV heads",
        )


def _check_arch(arch: Optional[Any], err: Callable[..., None]) -> None:
    """What the context group's attention cannot split (a sliding window and soft-capped scores can: the ring
    applies the window on the tokens' places in the whole rows and caps each score in its chunk pairs, the
    ulysses mode attends whole rows)."""
    if arch is None:
        return
    key = "parallel_config.context_parallel"
    if arch.position_embedding == "alibi":
        err(key, "context parallel does not support ALiBi attention biases", "use context_parallel: 1")
    if arch.linear_attention is not None:
        err(
            key,
            "context parallel does not support linear-attention layers (Qwen3.5's Gated DeltaNet): their "
            "recurrent state runs through the whole sequence in order",
            "use context_parallel: 1",
        )
