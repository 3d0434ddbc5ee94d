"""validate-config checks of models with Gated DeltaNet linear-attention layers (Qwen3.5,
models/linear_attention.py): tensor parallel splits their key and value heads (LoRA on their [q; k; v]
projection too, lora/split_parts.py), pipeline and data parallel take them as any layer, packed rows run
one sample per row there (in dygraph: to_static takes unpacked rows, the delta rule then in Paddle ops)."""

from __future__ import annotations

from typing import Any, Callable


def check_linear_attention(config: Any, arch: Any, err: Callable[..., None]) -> None:
    if arch is None or arch.linear_attention is None:
        return
    t, tp = config.train, config.parallel.tensor_parallel
    what = f"the {arch.family} linear attention (Gated DeltaNet)"
    heads = arch.linear_attention.num_key_heads
    if tp > 1 and heads % tp:
        err(
            "parallel_config.tensor_parallel",
            f"linear_num_key_heads ({heads}) is not divisible by tensor_parallel ({tp}): {what} splits its "
            "key heads (and with each its value heads) over the ranks",
            "use a tensor_parallel degree that divides the number of linear-attention key heads",
        )
    if t.to_static and t.batching == "packed":
        err(
            "train_config.to_static",
            f"{what} runs each sample of a packed row as its own row, cut where the segment ids change: a "
            "static program cannot re-cut its rows by their values",
            "use batching: max_length or longest with to_static, or set to_static: false",
        )
