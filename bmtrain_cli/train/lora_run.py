"""A LoRA training run (``finetuning: lora``): wrap the loaded base with adapters, record the base model's
path and hash, and gather the adapters (collectively under tensor/pipeline parallel) into the checkpoint
writer. The adapters-only checkpoint layout itself is lora/adapter_store.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
from paddle import nn

from bmtrain_cli.checkpoint_layout import atomic_directory
from bmtrain_cli.errors import UserError
from bmtrain_cli.lora.adapter_store import (
    FRESH_BASE_DIR,
    hash_base,
    is_lora_checkpoint,
    read_base_record,
    write_base_record,
)
from bmtrain_cli.lora.inject import LoRASettings, apply_lora, is_lora_name, lora_settings
from bmtrain_cli.lora.merge import adapter_arrays, load_adapter_arrays, load_adapter_weights, save_adapters
from bmtrain_cli.lora.quantized_merge import quantisation_record
from bmtrain_cli.lora.split_parts import fuse_adapter_arrays
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.quant.layer import summary as quant_summary

# ----------------------------------------------------------------------------- gathering under TP / PP


def whole_adapter_arrays(model: nn.Layer, ctx: Optional[ParallelCtx] = None) -> Dict[str, np.ndarray]:
    """Whole adapter tensors (our names, Paddle layout). Collective under tensor/pipeline/expert parallel:
    call it on every rank."""
    from bmtrain_cli.parallel.full_weights import unwrap

    inner = unwrap(model)
    if ctx is None or ctx.holds_whole_weights:
        return adapter_arrays(inner)
    if ctx.pp_degree > 1 or ctx.expert_group is not None:  # the experts' adapters from their ranks
        full = ctx.wrapping.full_state_dict(model, dequantize=False)  # a quantised base's codes stay
        return fuse_adapter_arrays({k: v for k, v in full.items() if is_lora_name(k)}, inner.arch)
    import paddle.distributed as dist

    group = ctx.hcg.get_model_parallel_group()
    out: Dict[str, np.ndarray] = {}
    for name, p in inner.state_dict().items():
        if not is_lora_name(name):
            continue
        if getattr(p, "is_distributed", False) and getattr(p, "split_axis", None) is not None:
            parts: List[Any] = []
            dist.all_gather(parts, p.detach(), group=group)
            out[name] = np.concatenate([x.numpy() for x in parts], axis=int(p.split_axis))
        else:
            out[name] = p.numpy()
    return fuse_adapter_arrays(
        out, inner.arch
    )  # a fused projection's parts (lora/split_parts.py) as one adapter


# ----------------------------------------------------------------------------- the trainer's side


class LoRARun:
    """What a LoRA training run keeps: settings, wrapped layers, and the base model's path and hash."""

    def __init__(self, settings: LoRASettings, wrapped: List[str]) -> None:
        self.settings = settings
        self.wrapped = wrapped
        self.base_path: Optional[str] = None
        self.base_sha256: Optional[str] = None
        self.quantization: Optional[Dict[str, Any]] = None  # a quantised base's settings (QLoRA)

    @classmethod
    def start(cls, model: nn.Layer, train_config: Any, resume_from: Optional[Path] = None) -> LoRARun:
        """Wrap the (already loaded) base with adapters; on resume load the checkpoint's adapters."""
        wrapped = apply_lora(model, train_config)
        run = cls(lora_settings(model), wrapped)
        if resume_from is not None:
            ckpt = Path(resume_from)
            if not is_lora_checkpoint(ckpt):
                raise UserError(
                    f"resume: {ckpt} is a full fine-tuning checkpoint but finetuning is lora; resume it with "
                    "finetuning: full, or start a LoRA run with model_name_or_path pointing at it"
                )
            load_adapter_weights(model, load_adapter_arrays(ckpt), str(ckpt))
            record = read_base_record(ckpt)
            run.base_path, run.base_sha256 = record["base_model_name_or_path"], record["base_model_sha256"]
        return run

    def record_base(
        self, config: Any, output_dir: Path, model: nn.Layer, ctx: Optional[ParallelCtx] = None
    ) -> None:
        """Remember the base model's path and hash; a fresh (random) base is written once to
        output_dir/base_model first. Collective under tensor/pipeline parallel (call on every rank)."""
        q = getattr(config.model, "quantization", None)  # this run's (a resume may change it)
        self.quantization = quantisation_record(q) if q is not None else None
        if self.base_path is not None:
            return
        is_main = ctx.is_main if ctx is not None else True
        source = getattr(config.model, "model_name_or_path", None)
        if source:
            base = Path(source).resolve()
        else:
            base = (Path(output_dir) / FRESH_BASE_DIR).resolve()
            tensors = _whole_base_arrays(model, ctx)
            if is_main:
                _save_base(model, tensors, base)
            if ctx is not None and ctx.world_size > 1:
                ctx.collectives.barrier()
        self.base_path = str(base)
        self.base_sha256 = hash_base(base) if is_main else None

    def weights_writer(
        self, model: nn.Layer, ctx: Optional[ParallelCtx] = None
    ) -> Callable[[Any, str], None]:
        """Gather the adapters now (collective) and return the ``weights_writer`` for
        train.checkpoint.training_state.save_checkpoint: adapters (PEFT layout) + base record + config.json."""
        from bmtrain_cli.models.arch import arch_to_hf_dict
        from bmtrain_cli.parallel.full_weights import unwrap

        arrays = whole_adapter_arrays(model, ctx)
        arch = unwrap(model).arch

        def writer(_model: Any, out_dir: str) -> None:
            if self.base_path is None or self.base_sha256 is None:
                raise UserError("LoRA: the base model was not recorded before saving")
            save_adapters(out_dir, self.settings, arrays, self.base_path)
            write_base_record(out_dir, self.base_path, self.base_sha256, self.quantization)
            cfg = arch_to_hf_dict(arch, "float32")
            (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")

        return writer

    def describe(self, model: nn.Layer, total_parameters: int) -> str:
        from bmtrain_cli.lora.inject import trainable_count

        n = trainable_count(model)
        s = self.settings
        line = (
            f"LoRA rank {s.rank} (alpha {s.alpha:g}, dropout {s.dropout:g}) on {len(self.wrapped)} layers "
            f"({', '.join(s.target_modules)}): {n:,} trainable parameters "
            f"({100 * n / (total_parameters + n):.2f}% of {total_parameters + n:,})"
        )
        quantised = quant_summary(model)
        return f"{line}; {quantised}" if quantised else line


def _whole_base_arrays(model: nn.Layer, ctx: Optional[ParallelCtx]) -> Dict[str, np.ndarray]:
    """Whole base weights (no adapters) under single-process names; collective under TP/PP."""
    from bmtrain_cli.parallel.full_weights import dequantized_weights, unwrap

    if ctx is not None and not ctx.holds_whole_weights:
        full = ctx.wrapping.full_state_dict(model)
    else:
        full = {n: p.numpy() for n, p in unwrap(model).state_dict().items()}
        full.update(dequantized_weights(model))  # a quantised base's layers hold codes (QLoRA)
    return {k: v for k, v in full.items() if not is_lora_name(k)}


def _save_base(model: nn.Layer, tensors: Dict[str, np.ndarray], out: Path) -> None:
    """Write the fresh base model to ``out`` atomically (a killed run leaves no half-written base)."""
    from bmtrain_cli.models import save_pretrained
    from bmtrain_cli.parallel.full_weights import FullWeights, unwrap

    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out, f".{out.name}.tmp-{os.getpid()}", create=False) as tmp:
        save_pretrained(FullWeights(unwrap(model).arch, tensors), str(tmp))
