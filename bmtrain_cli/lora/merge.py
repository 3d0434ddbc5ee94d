"""Merge adapters into the base weights, and the PEFT file layout.

PEFT layout (what ``peft.PeftModel.from_pretrained`` reads): ``adapter_config.json`` and
``adapter_model.safetensors`` whose keys are ``base_model.model.<HF module name>.lora_A.weight`` ([r, in])
and ``...lora_B.weight`` ([out, r]), i.e. Hugging Face's [out, in] orientation (ours is [in, out]).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.lora.inject import HOOK_ATTR, LoRASettings, is_lora_name, lora_layers, lora_settings
from bmtrain_cli.lora.layers import LoRALinear
from bmtrain_cli.lora.peft_experts import (
    has_expert_adapters,
    mlp_targets,
    peft_expert_layout,
    split_expert_layout,
)
from bmtrain_cli.lora.split_parts import split_adapter_arrays

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def merge_lora(model: nn.Layer) -> int:
    """Fold every adapter into its base weight (forward then skips the adapters); returns the count."""
    layers = lora_layers(model)
    for _, layer in layers:
        layer.merge()
    return len(layers)


def unmerge_lora(model: nn.Layer) -> int:
    layers = lora_layers(model)
    for _, layer in layers:
        layer.unmerge()
    return len(layers)


def strip_lora(model: nn.Layer, merge: bool = True) -> nn.Layer:
    """Replace every LoRA wrapper by its base layer (merging first unless ``merge`` is False), leaving a
    plain model with the original parameter names. The base weights become trainable again."""
    if merge:
        merge_lora(model)
    for name, layer in lora_layers(model):
        parent = model
        parts = name.split(".")
        for part in parts[:-1]:
            parent = getattr(parent, part)
        setattr(parent, parts[-1], layer.base_layer)
    for p in model.parameters():
        p.stop_gradient = False
    if lora_settings(model) is not None:
        object.__delattr__(model, "lora_settings")
    handle = model.__dict__.pop(HOOK_ATTR, None)
    if handle is not None:
        handle.remove()
    return model


# ----------------------------------------------------------------------------- PEFT tensors


def adapter_arrays(model: nn.Layer) -> Dict[str, np.ndarray]:
    """This process's adapter weights by our parameter names (Paddle layout; local shards under TP)."""
    return {n: p.numpy() for n, p in model.state_dict().items() if is_lora_name(n)}


def to_peft_tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Our names/layout (whole tensors) -> PEFT keys and [out, in] orientation."""
    out = {}
    for name, arr in arrays.items():
        if not is_lora_name(name):
            continue
        a = np.asarray(arr)
        if a.dtype != np.float32:
            a = a.astype(np.float32)
        out[PEFT_PREFIX + name] = np.ascontiguousarray(a.T)
    return out


def from_peft_tensors(tensors: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """PEFT keys -> our names and [in, out] layout. PEFT's adapter-name infix (``lora_A.default.weight``)
    is accepted too."""
    out = {}
    for key, arr in tensors.items():
        name = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        name = name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        out[name] = np.ascontiguousarray(np.asarray(arr).T)
    return out


def peft_config(settings: LoRASettings, base_model_name_or_path: Optional[str] = None) -> Dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": list(settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_adapters(
    out_dir: str,
    settings: LoRASettings,
    arrays: Dict[str, np.ndarray],
    base_model_name_or_path: Optional[str] = None,
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors from whole adapter arrays (our names). Adapters
    on a mixture of experts' routed experts are written as PEFT adapts transformers 5.x's stacked experts
    (lora/peft_experts.py), so a checkpoint and ``export --no-merge`` both load in PEFT."""
    from bmtrain_cli.models.safetensors_io import save_numpy_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = peft_config(settings, base_model_name_or_path)
    if has_expert_adapters(arrays):
        tensors, entries = peft_expert_layout(arrays, settings, PEFT_PREFIX)
        cfg.update(entries)
    else:
        tensors = to_peft_tensors(arrays)
    save_numpy_file(tensors, d / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (d / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return d


def read_adapter_config(path: Any) -> Dict[str, Any]:
    f = Path(path) / ADAPTER_CONFIG
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{f}: cannot read the LoRA adapter config ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{f}: not a JSON object")
    return cfg


def settings_from_adapter_config(cfg: Dict[str, Any], source: str = "adapter_config.json") -> LoRASettings:
    try:
        targets = cfg["target_modules"] or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        targets += mlp_targets(cfg)  # the MLP projections of a mixture of experts (lora/peft_experts.py)
        return LoRASettings(
            rank=int(cfg["r"]),
            alpha=float(cfg["lora_alpha"]),
            dropout=float(cfg.get("lora_dropout", 0.0)),
            target_modules=tuple([targets] if isinstance(targets, str) else targets),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{source}: LoRA adapters only, but the adapter config is incomplete ({exc})"
        ) from None


def load_adapter_arrays(path: Any) -> Dict[str, np.ndarray]:
    """Whole adapter tensors (our names, Paddle layout) of a PEFT directory."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    f = Path(path) / ADAPTER_WEIGHTS
    if not f.is_file():
        raise UserError(f"{Path(path)}: LoRA adapters only, but {ADAPTER_WEIGHTS} is missing")
    try:
        tensors = load_file(str(f))
        cfg = read_adapter_config(path)
        if cfg.get(
            "target_parameters"
        ):  # stacked experts' adapters (export --no-merge, lora/peft_experts.py)
            tensors = split_expert_layout(tensors, cfg)
        return from_peft_tensors(tensors)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{f}: unreadable or truncated adapter weights ({exc})") from None


def load_adapter_weights(model: nn.Layer, arrays: Dict[str, np.ndarray], source: str = "adapters") -> None:
    """Copy whole adapter arrays (our names, [in, out]) into a model with adapters, slicing this rank's
    shard of tensor-parallel-split adapters (a fused projection's adapter onto the parts tensor parallel
    holds it as, lora/split_parts.py)."""
    arrays = split_adapter_arrays(model, arrays)
    params = {n: p for n, p in model.state_dict().items() if is_lora_name(n)}
    missing = sorted(set(params) - set(arrays))
    unexpected = sorted(set(arrays) - set(params))
    if missing or unexpected:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise UserError(f"{source}: the adapters do not fit this model ({detail})")
    owners: Dict[str, LoRALinear] = {}
    for lname, layer in lora_layers(model):
        owners[f"{lname}.lora_A.weight"] = layer
        owners[f"{lname}.lora_B.weight"] = layer
    for name, p in params.items():
        arr = np.asarray(arrays[name])
        axis = getattr(p, "split_axis", None) if getattr(p, "is_distributed", False) else None
        owner = owners.get(name)
        if axis is not None and owner is not None and owner.tp_world > 1:
            n = arr.shape[axis] // owner.tp_world
            arr = np.take(arr, np.arange(owner.tp_rank * n, (owner.tp_rank + 1) * n), axis=axis)
        if list(arr.shape) != list(p.shape):
            raise UserError(
                f"{source}: adapter {name} has shape {list(arr.shape)}, the model expects {p.shape}"
            )
        p.set_value(paddle.to_tensor(np.ascontiguousarray(arr, dtype=np.float32)).astype(p.dtype))
