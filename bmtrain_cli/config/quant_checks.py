"""validate-config checks of a quantised frozen base (model_config.quantization, QLoRA): what this first
slice runs. The base's linear layers hold low-bit codes (bmtrain_cli/quant/) and no gradient, so only a
frozen-base method trains on them; the layouts and features that would split or re-read the base weights
are refused here with the reason rather than half-supported."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.config.refusals import refuse_model_parallel
from bmtrain_cli.quant.select import HEAD_NAME


def check_quantization(config: Any, arch: Any, err: Callable[..., None]) -> None:
    m, t, p = config.model, config.train, config.parallel
    q = m.quantization
    if q is None:
        return
    key = "model_config.quantization"
    if t.finetuning != "lora":
        err(
            "train_config.finetuning",
            f"a quantised base ({key}.method: {q.method}) is frozen: its codes have no gradient, so only "
            "LoRA trains on it",
            "set finetuning: lora, or remove model_config.quantization",
        )
    refuse_model_parallel(
        p,
        "a quantised base",
        "the codes are not split across ranks",
        "use data_parallel, or remove model_config.quantization",
        err,
    )
    if t.to_static:
        err(
            "train_config.to_static",
            "a quantised base runs in dygraph only in this version",
            "set to_static: false",
        )
    if arch is not None and arch.num_experts:
        err(
            f"{key}.method",
            f"quantising the experts of the {arch.family} mixture of experts is not supported yet",
            "remove model_config.quantization",
        )
    if q.block_size is not None and q.method == "int8":
        err(
            f"{key}.block_size",
            "int8 has one scale per output channel and no block size",
            "remove block_size",
        )
    if q.double_quant and q.method != "nf4":
        err(f"{key}.double_quant", f"double_quant quantises nf4's absmax; {q.method} has none", "remove it")
    if q.double_quant and not m.model_name_or_path:
        err(
            f"{key}.double_quant",
            "a fresh model's base is saved dequantised (output_dir/base_model); re-quantising it on resume "
            "reproduces nf4's codes but not double-quantised scales, so the resume would not be exact",
            "use double_quant with a checkpoint (model_name_or_path), or set double_quant: false",
        )
    if q.compute_dtype is not None and q.compute_dtype != m.dtype:
        err(
            f"{key}.compute_dtype",
            f"the dequantised weight is multiplied in model_config.dtype ({m.dtype}); a different "
            f"compute_dtype ({q.compute_dtype}) is not supported yet",
            f"remove compute_dtype or set it to {m.dtype}",
        )
    if HEAD_NAME not in q.skip_modules:
        err(
            f"{key}.skip_modules",
            "the LM head cannot be quantised: the loss reads its weight directly (chunked cross-entropy)",
            f"keep {HEAD_NAME} in skip_modules",
        )
