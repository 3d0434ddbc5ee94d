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
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.lora.inject import LoRASettings, apply_lora
from bmtrain_cli.lora.merge import (
    ADAPTER_CONFIG,
    load_adapter_arrays,
    load_adapter_weights,
    read_adapter_config,
    settings_from_adapter_config,
    strip_lora,
)
from bmtrain_cli.lora.quantized_merge import (
    MergeError,
    base_dtype,
    dequantize_base,
    quantised_names,
)
from bmtrain_cli.models.layers import LayerFactory

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
