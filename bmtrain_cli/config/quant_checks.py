"""validate-config checks of a quantised frozen base (model_config.quantization, QLoRA): what this first
slice runs. The base's linear layers hold low-bit codes (bmtrain_cli/quant/) and no gradient, so only a
frozen-base method trains on them; the layouts and features that would split or re-read the base weights
are refused here with the reason rather than half-supported."""

from __future__ import annotations

from typing import Any, Callable

from bmtrain_cli.quant.formats import shard_mismatch
from bmtrain_cli.quant.select import EMBED_NAME, HEAD_NAME, is_skipped


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
    if p.tensor_parallel > 1 and arch is not None:
        _check_shards(q, arch, p.tensor_parallel, err)
    if t.to_static:
        err(
            "train_config.to_static",
            "a quantised base runs in dygraph only in this version",
            "set to_static: false",
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
    _check_vocab(q, arch, p, err)


def _check_vocab(q: Any, arch: Any, p: Any, err: Callable[..., None]) -> None:
    """The input embedding and the LM head, when quantised, are int8 (per vocabulary row, quant/vocab.py,
    whatever the method of the linear layers), held whole on one process, and not Baichuan2's normalised
    head (normalised per row at every step)."""
    taken = [n for n in (EMBED_NAME, HEAD_NAME) if not is_skipped(f"model.{n}", q.skip_modules)]
    if not taken:
        return
    why = ""
    if p.tensor_parallel > 1 or p.pipeline_parallel > 1:
        why = "they are quantised whole, on one process (no tensor or pipeline parallel split of them)"
    elif arch is not None and arch.norm_head:
        why = "this family normalises the head's rows at every step (norm_head), which needs its weight"
    if why:
        err(
            "model_config.quantization.skip_modules",
            f"{' and '.join(taken)} cannot be quantised here: {why}",
            f"keep {' and '.join(taken)} in skip_modules",
        )


def _check_shards(q: Any, arch: Any, tp: int, err: Callable[..., None]) -> None:
    """Tensor parallel: each rank quantises its own shard of the column- and row-parallel projections;
    the block size must not let a block straddle a shard boundary, so the shards' codes and scales are
    the whole weight's (quant/formats.shard_mismatch) and tp equals one process."""
    attn, kv, f, h = (
        arch.num_attention_heads * arch.head_dim,
        arch.num_key_value_heads * arch.head_dim,
        arch.intermediate_size,
        arch.hidden_size,
    )
    shards = [  # (module, column or row, whole out, whole in)
        ("q_proj", "column", attn, h),
        ("k_proj", "column", kv, h),
        ("v_proj", "column", kv, h),
        ("o_proj", "row", h, attn),
        ("gate_proj", "column", f, h),
        ("up_proj", "column", f, h),
        ("down_proj", "row", h, f),
    ]
    for name, kind, out_f, in_f in shards:
        if is_skipped(name, q.skip_modules) or (out_f if kind == "column" else in_f) % tp:
            continue  # divisibility by tensor_parallel is checked with the model
        out_l, in_l = (out_f // tp, in_f) if kind == "column" else (out_f, in_f // tp)
        why = shard_mismatch(q.method, q.resolved_block_size, kind, out_l, in_l)
        if why:
            err(
                "model_config.quantization.block_size",
                f"under tensor_parallel {tp} each rank quantises its own shard of {name}, and {why}: the "
                "shards would not hold the whole weight's codes",
                "choose a block_size that divides every shard (a power of two dividing "
                f"{in_l if kind == 'row' else out_l * in_l}), or add {name} to skip_modules",
            )
            return
