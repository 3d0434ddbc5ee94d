"""Merging the adapters of a QLoRA run (LoRA on a quantised base, model_config.quantization).

The adapters were trained against the dequantised base, so the merged model is that base plus the
adapters: every layer the run quantised is quantised again with the run's settings (recorded in the
checkpoint's lora_base.json; the same codes as in training, bmtrain_cli/quant/) and dequantised, then the
adapters are added, and the export writes the result in the base checkpoint's dtype. The quantisation error
is measured on those merged weights, as written, against the original base plus the same adapters.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.lora.layers import LoRALinear
from bmtrain_cli.quant.layer import quantizable, quantize_linear

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MergeError:
    """The quantisation error of the merged weights (dequantised base + adapters, in ``dtype``) against
    the original base + adapters, over the ``layers`` quantised layers."""

    method: str
    dtype: str
    layers: int
    max_abs: float  # largest |merged - exact| of any weight
    relative: float  # ||merged - exact|| / ||exact|| over all quantised weights (Frobenius)
    worst_layer: str
    worst_relative: float  # the same ratio in the layer where it is largest

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"merged onto the {self.method}-dequantised base it trained on, in the base's {self.dtype}; "
            f"quantisation error of the merged weights vs the original base + adapters over {self.layers} "
            f"layers: relative {self.relative:.4f} (worst {self.worst_layer}: {self.worst_relative:.4f}), "
            f"max abs {self.max_abs:.3g}"
        )


def quantisation_record(q: Any) -> Dict[str, Any]:
    """What lora_base.json keeps of model_config.quantization: enough to quantise the base again."""
    return {
        "method": q.method,
        "block_size": q.resolved_block_size,
        "double_quant": bool(q.double_quant),
        "skip_modules": list(q.skip_modules),
    }


def _settings(record: Dict[str, Any]) -> Any:
    return SimpleNamespace(
        method=record["method"],
        resolved_block_size=int(record.get("block_size") or 0),
        double_quant=bool(record.get("double_quant", False)),
        skip_modules=list(record.get("skip_modules", [])),
    )


def quantised_names(model: nn.Layer, record: Dict[str, Any]) -> List[str]:
    """The linear layers of a plain (not yet LoRA-wrapped) model the recorded settings quantise."""
    return list(quantizable(model, _settings(record)))


def base_dtype(base: Path) -> str:
    """The dtype of the base checkpoint's weights (config.json's torch_dtype / dtype; float32 if unsaid)."""
    try:
        cfg = json.loads((Path(base) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "float32"
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return dtype if dtype in FLOAT_DTYPES else "float32"


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x
    cast: Any = dtype
    return paddle.to_tensor(x).astype(cast).astype("float32").numpy()


def dequantize_base(model: nn.Layer, names: List[str], record: Dict[str, Any], dtype: str) -> MergeError:
    """Replace the weight of each of ``names`` (a model with its adapters loaded, base in fp32) by its
    quantised-then-dequantised value, one layer at a time, and measure the merged weights' error (see the
    module docstring). The adapters stay unmerged: strip_lora merges them afterwards."""
    settings = _settings(record)
    sq_err = sq_ref = 0.0
    max_abs, worst, worst_name = 0.0, -1.0, ""
    for name in names:
        layer: Any = model
        for part in name.split("."):
            layer = getattr(layer, part)
        base = layer.base_layer if isinstance(layer, LoRALinear) else layer
        weight = layer.weight
        original = weight.numpy().astype(np.float32)
        delta = layer.delta_weight().numpy() if isinstance(layer, LoRALinear) else 0.0
        quantised = quantize_linear(base, original, settings, "reference", name=name)
        dequantized = quantised.dequantized_weight().astype("float32").numpy()
        exact = original + delta
        diff = _rounded((dequantized + delta).astype(np.float32), dtype) - exact
        err, ref = (
            float(np.square(diff, dtype=np.float64).sum()),
            float(np.square(exact, dtype=np.float64).sum()),
        )
        sq_err, sq_ref = sq_err + err, sq_ref + ref
        max_abs = max(max_abs, float(np.abs(diff).max()))
        rel = (err / ref) ** 0.5 if ref > 0 else 0.0
        if rel > worst:
            worst, worst_name = rel, name
        with paddle.no_grad():
            weight.set_value(paddle.to_tensor(dequantized).astype(weight.dtype))
    relative = (sq_err / sq_ref) ** 0.5 if sq_ref > 0 else 0.0
    return MergeError(record["method"], dtype, len(names), max_abs, relative, worst_name, max(worst, 0.0))
