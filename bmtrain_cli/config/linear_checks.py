"""validate-config checks of models with Gated DeltaNet linear-attention layers (Qwen3.5,
models/linear_attention.py): tensor parallel splits their key and value heads, pipeline and data
parallel take them as any layer, packed rows run one sample per row there; they train in dygraph."""

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
    if tp > 1 and t.finetuning == "lora":
        err(
            "train_config.finetuning",
            f"LoRA on {what} under tensor_parallel > 1 is not supported yet (its fused [q; k; v] projection "
            "is held as three split parts there)",
            "use tensor_parallel: 1 with LoRA (data_parallel and pipeline_parallel work)",
        )
    if t.to_static:
        err(
            "train_config.to_static",
            f"{what} is not trained as a static graph yet (its chunk loop is only exported for inference)",
            "set to_static: false",
        )
