"""Adapters-only checkpoints: the adapters (PEFT layout), the base model's path and a hash of its
weights, so that resume and export find the base and can tell when it changed.

A LoRA ``step-N`` holds adapter_config.json + adapter_model.safetensors, ``lora_base.json`` (base path,
sha256 of its weight files) and config.json (the base architecture), next to the trainer's usual
tokenizer / optimizer.safetensors (adapters only) / trainer_state.json. A run whose base is a fresh
random model writes that base once to ``output_dir/base_model`` and points there.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
from paddle import nn

from bmtrain_cli.checkpoint_layout import atomic_directory
from bmtrain_cli.errors import UserError
from bmtrain_cli.lora.inject import LoRASettings, apply_lora, is_lora_name, lora_settings
from bmtrain_cli.lora.merge import (
    ADAPTER_CONFIG,
    adapter_arrays,
    load_adapter_arrays,
    load_adapter_weights,
    read_adapter_config,
    save_adapters,
    settings_from_adapter_config,
    strip_lora,
)
from bmtrain_cli.lora.quantized_merge import (
    MergeError,
    base_dtype,
    dequantize_base,
    quantisation_record,
    quantised_names,
)
from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.quant.layer import summary as quant_summary

BASE_FILE = "lora_base.json"
FRESH_BASE_DIR = "base_model"
_CHUNK = 1 << 20


def is_lora_checkpoint(path: Any) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def weight_files(base: Path) -> List[Path]:
    """The weight files whose bytes identify a base model (safetensors files and their index)."""
    files = sorted(base.glob("*.safetensors"))
    index = base / "model.safetensors.index.json"
    return ([index] if index.is_file() else []) + files


def hash_base(path: Any) -> str:
    """sha256 over the names and bytes of the base model's weight files."""
    base = Path(path)
    files = weight_files(base)
    if not files:
        raise UserError(f"LoRA base model {base}: no *.safetensors weights there")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode("utf-8") + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(_CHUNK), b""):
                h.update(block)
    return h.hexdigest()


def write_base_record(
    out_dir: Any, base_path: str, sha256: str, quantization: Optional[Dict[str, Any]] = None
) -> None:
    """lora_base.json: the base's path and hash and, for a quantised base (QLoRA), how it was quantised
    (lora/quantized_merge.py reads it back to merge the adapters onto the same dequantised base)."""
    record: Dict[str, Any] = {"base_model_name_or_path": base_path, "base_model_sha256": sha256}
    if quantization is not None:
        record["quantization"] = quantization
    (Path(out_dir) / BASE_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def read_base_record(ckpt: Any) -> Dict[str, Any]:
    f = Path(ckpt) / BASE_FILE
    if not f.is_file():
        raise UserError(
            f"{ckpt} holds LoRA adapters only and has no {BASE_FILE} naming its base model; merge it with "
            "the base it was trained on (peft) or retrain"
        )
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
        record["base_model_name_or_path"], record["base_model_sha256"]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{f}: unreadable LoRA base record ({exc})") from None
    return record


def find_base(ckpt: Any, alternatives: Optional[List[str]] = None) -> Path:
    """The verified base model directory of a LoRA checkpoint: the recorded path, else one of
    ``alternatives`` (e.g. the config's model_name_or_path when the base moved) whose weights hash the
    same. UserError when the base is missing or its weights changed."""
    record = read_base_record(ckpt)
    want = record["base_model_sha256"]
    recorded = str(record["base_model_name_or_path"])
    candidates = [recorded] + [a for a in (alternatives or []) if a and a != recorded]
    changed = []
    for c in candidates:
        p = Path(c)
        if not (p / "config.json").is_file() or not weight_files(p):
            continue
        got = hash_base(p)
        if got == want:
            return p
        changed.append(f"{p} (sha256 {got[:12]}...)")
    if changed:
        raise UserError(
            f"LoRA checkpoint {ckpt}: the base model's weights changed since training: expected sha256 "
            f"{want[:12]}... but found {', '.join(changed)}. Adapters only fit the exact base they were "
            "trained on; restore that base (or point model_name_or_path at a copy of it)"
        )
    raise UserError(
        f"LoRA checkpoint {ckpt}: its base model {recorded} cannot be found (no config.json and "
        "*.safetensors there). Put the base back at that path, or set model_config.model_name_or_path "
        "to a copy of it (verified by its sha256)"
    )


# ----------------------------------------------------------------------------- loading


def _settings_namespace(settings: LoRASettings) -> Any:
    return SimpleNamespace(
        lora_rank=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        lora_target_modules=list(settings.target_modules),
    )


def load_lora_checkpoint(
    path: Any,
    *,
    merge: bool = False,
    kernels: str = "auto",
    factory: Optional[LayerFactory] = None,
    dtype: Optional[str] = None,
    alternatives: Optional[List[str]] = None,
) -> nn.Layer:
    """Base model (found and verified) + the checkpoint's adapters. ``merge``: fold them in and return a
    plain model (Hugging Face names only), onto the original base weights (a QLoRA run's adapters too:
    :func:`merge_checkpoint` merges those onto the dequantised base they were trained on)."""
    return _load_lora(path, merge, kernels, factory, dtype, alternatives)[0]


def _load_lora(
    path: Any,
    merge: bool,
    kernels: str = "auto",
    factory: Any = None,
    dtype: Optional[str] = None,
    alternatives: Optional[List[str]] = None,
    dequantize: bool = False,
) -> Tuple[nn.Layer, Optional[MergeError]]:
    from bmtrain_cli.models import load_pretrained

    ckpt = Path(path)
    settings = settings_from_adapter_config(read_adapter_config(ckpt), str(ckpt / ADAPTER_CONFIG))
    arrays = load_adapter_arrays(ckpt)
    base = find_base(ckpt, alternatives)
    model = load_pretrained(str(base), dtype=dtype, kernels=kernels, factory=factory)
    quantization = read_base_record(ckpt).get("quantization") if dequantize else None
    quantised = quantised_names(model, quantization) if quantization else []
    apply_lora(model, _settings_namespace(settings))
    load_adapter_weights(model, arrays, str(ckpt))
    model.eval()
    error = None
    if quantization:
        error = dequantize_base(model, quantised, quantization, base_dtype(base))
    return (strip_lora(model, merge=True) if merge else model), error


def merge_checkpoint(path: str, kernels: str = "auto") -> nn.Layer:
    """The export hook: a LoRA checkpoint's base with the adapters merged in (a plain CausalLM)."""
    return merge_checkpoint_measured(path, kernels)[0]


def merge_checkpoint_measured(path: str, kernels: str = "auto") -> Tuple[nn.Layer, Optional[MergeError]]:
    """:func:`merge_checkpoint` and, for a QLoRA run, the quantisation error measured on the merged
    weights: its adapters merge onto the base it trained on, each quantised layer quantised with the run's
    settings and dequantised (lora/quantized_merge.py)."""
    return _load_lora(path, merge=True, kernels=kernels, dequantize=True)


# ----------------------------------------------------------------------------- gathering under TP / PP


def whole_adapter_arrays(model: nn.Layer, ctx: Optional[ParallelCtx] = None) -> Dict[str, np.ndarray]:
    """Whole adapter tensors (our names, Paddle layout). Collective under tensor/pipeline parallel:
    call it on every rank."""
    from bmtrain_cli.parallel.full_weights import unwrap

    inner = unwrap(model)
    if ctx is None or (ctx.tp_degree == 1 and ctx.pp_degree == 1):
        return adapter_arrays(inner)
    if ctx.pp_degree > 1:
        return {k: v for k, v in ctx.full_state_dict(model).items() if is_lora_name(k)}
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
    return out


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
                ctx.barrier()
        self.base_path = str(base)
        self.base_sha256 = hash_base(base) if is_main else None

    def weights_writer(
        self, model: nn.Layer, ctx: Optional[ParallelCtx] = None
    ) -> Callable[[Any, str], None]:
        """Gather the adapters now (collective) and return the ``weights_writer`` for
        train.training_state.save_checkpoint: adapters (PEFT layout) + base record + config.json."""
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

    if ctx is not None and (ctx.tp_degree > 1 or ctx.pp_degree > 1):
        full = ctx.full_state_dict(model)
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
