"""What an export records about itself: ``bmtrain_export.json`` (format, source, quantisation, sizes, the
size/loss report) and the :class:`ExportResult` `bmtrain export` reports. Every exporter (export/pipeline.py,
export/paddle_inference.py, export/peft.py) and the loader (export/loading.py) use it; it imports none of
them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from bmtrain_cli.errors import UserError

META_FILE = "bmtrain_export.json"


def read_export_meta(path: Path) -> Dict[str, Any]:
    f = Path(path) / META_FILE
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{f}: not valid JSON ({exc})") from None


@dataclass
class ExportResult:
    checkpoint: Path
    output: Path
    format: str
    quantize: Optional[str]
    fp32_bytes: int  # what the same weights take in fp32
    export_weight_bytes: int  # weight files written (pdiparams or safetensors)
    quantized_linear: List[str] = field(default_factory=list)
    quantized_embedding: List[str] = field(default_factory=list)
    eval_data: Optional[str] = None
    eval_records: int = 0
    eval_loss_fp32: Optional[float] = None
    eval_loss_quantized: Optional[float] = None
    # a QLoRA checkpoint merged onto its dequantised base: lora/quantized_merge.MergeError.to_dict()
    quantized_base: Optional[Dict[str, Any]] = None

    @property
    def size_ratio(self) -> float:
        return self.export_weight_bytes / self.fp32_bytes

    @property
    def eval_loss_change(self) -> Optional[float]:
        """Relative change of the held-out loss caused by quantisation."""
        if self.eval_loss_fp32 is None or self.eval_loss_quantized is None:
            return None
        return (self.eval_loss_quantized - self.eval_loss_fp32) / self.eval_loss_fp32

    def to_dict(self) -> Dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint),
            "format": self.format,
            "quantization": self.quantize,
            "fp32_bytes": self.fp32_bytes,
            "export_weight_bytes": self.export_weight_bytes,
            "size_ratio": self.size_ratio,
            "quantized_linear": self.quantized_linear,
            "quantized_embedding": self.quantized_embedding,
            "eval_data": self.eval_data,
            "eval_records": self.eval_records,
            "eval_loss_fp32": self.eval_loss_fp32,
            "eval_loss_quantized": self.eval_loss_quantized,
            "eval_loss_change": self.eval_loss_change,
            "quantized_base": self.quantized_base,
        }


def write_export_meta(directory: Path, meta: Dict[str, Any]) -> None:
    """Write ``meta`` into ``directory``'s bmtrain_export.json, keeping what an exporter wrote there first."""
    merged = read_export_meta(directory)
    merged.update(meta)
    (Path(directory) / META_FILE).write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
