"""Hugging Face-style export: config.json + safetensors + tokenizer files + chat template.

Full precision goes through ``models.save_pretrained`` (the same writer as training checkpoints). The INT8
variant stores, for every quantised layer ``X``, ``X.weight`` as int8 in the Hugging Face layout
([out, in] for linear layers, [vocab, hidden] for embeddings) and ``X.weight_scale`` (fp32, one per output
channel / row); config.json gets a ``quantization_config`` naming the method and the quantised layers.
:func:`load_quantized` reads it back into a model with int8 buffers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import paddle

from bmtrain_cli.errors import UserError
from bmtrain_cli.export.quantize import (
    QUANT_METHOD,
    SCALE_SUFFIX,
    QuantEmbedding,
    QuantLinear,
    QuantReport,
    make_quantized_skeleton,
)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_SHARD_BYTES = 2 * 1024**3


def write_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Tokenizer files (via Tokenizer.save) and, when it has one, the chat template as its own file too."""
    if tokenizer is None:
        return
    tokenizer.save(str(out_dir))
    template = getattr(tokenizer, "chat_template", None)
    if template:
        (Path(out_dir) / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")


def _sublayer(model: paddle.nn.Layer, name: str) -> paddle.nn.Layer:
    layer = model
    for part in name.split("."):
        layer = getattr(layer, part)
    return layer


def quantized_hf_tensors(model: paddle.nn.Layer, report: QuantReport) -> Dict[str, np.ndarray]:
    """The Hugging Face-named tensors of a quantised model: int8 weights + fp32 scales + the rest fp32."""
    tensors: Dict[str, np.ndarray] = {}
    linear_modules = {n for n, m in model.named_sublayers() if isinstance(m, paddle.nn.Linear)}
    for name, p in model.named_parameters():
        arr = p.numpy().astype(np.float32)
        module = name.rsplit(".", 1)[0]
        if module in linear_modules and name.endswith(".weight") and arr.ndim == 2:
            arr = arr.T  # a layer left in fp32: Paddle [in, out] -> HF [out, in]
        tensors[name] = np.ascontiguousarray(arr)
    for name in report.linear:
        layer = _sublayer(model, name)
        assert isinstance(layer, QuantLinear)
        tensors[f"{name}.weight"] = np.ascontiguousarray(layer.qweight.numpy().T)
        tensors[f"{name}.{SCALE_SUFFIX}"] = getattr(layer, SCALE_SUFFIX).numpy()
    for name in report.embedding:
        layer = _sublayer(model, name)
        assert isinstance(layer, QuantEmbedding)
        tensors[f"{name}.weight"] = np.ascontiguousarray(layer.qweight.numpy())
        tensors[f"{name}.{SCALE_SUFFIX}"] = getattr(layer, SCALE_SUFFIX).numpy()
    return tensors


def write_safetensors(tensors: Dict[str, np.ndarray], out_dir: Path, max_shard_size_bytes: int) -> List[Path]:
    """One model.safetensors, or shards model-0000i-of-0000n.safetensors + index above the limit."""
    from bmtrain_cli.models.safetensors_io import save_numpy_file

    shards: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        save_numpy_file(shards[0], out_dir / WEIGHTS_NAME, metadata={"format": "pt"})
        return [out_dir / WEIGHTS_NAME]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_numpy_file(shard, out_dir / fname, metadata={"format": "pt"})
        paths.append(out_dir / fname)
        weight_map.update({k: fname for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    return paths


def quantization_config(report: QuantReport) -> Dict[str, Any]:
    return {
        "quant_method": QUANT_METHOD,
        "bits": 8,
        "symmetric": True,
        "granularity": "per_output_channel",
        "weight_dtype": "int8",
        "scale_suffix": SCALE_SUFFIX,
        "linear": list(report.linear),
        "embedding": list(report.embedding),
    }


def export_hf(
    model: paddle.nn.Layer,
    out_dir: str,
    tokenizer: Any = None,
    report: Optional[QuantReport] = None,
    source_config: Optional[Dict[str, Any]] = None,
    max_shard_size_bytes: int = DEFAULT_SHARD_BYTES,
) -> List[Path]:
    """Write a Hugging Face-style directory. Returns the weight files written.

    ``report`` (from quantize_model) selects the INT8 layout; it then needs ``source_config``, the
    config.json dict of the checkpoint the model came from, to which ``quantization_config`` is added.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if report is None:
        from bmtrain_cli.models import save_pretrained

        save_pretrained(model, str(out), max_shard_size_bytes=max_shard_size_bytes)
        files = sorted(out.glob("*.safetensors"))
    else:
        if source_config is None:
            raise ValueError("a quantised hf export needs the source config.json")
        cfg = dict(source_config)
        cfg["quantization_config"] = quantization_config(report)
        cfg["torch_dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        files = write_safetensors(quantized_hf_tensors(model, report), out, max_shard_size_bytes)
    write_tokenizer(tokenizer, out)
    return files


def weight_files(path: Path) -> List[Path]:
    """The safetensors files of an HF-style directory (from the index when sharded); UserError if any is
    missing."""
    path = Path(path)
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise UserError(f"{index}: not a valid safetensors index ({exc})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise UserError(f"{path}: partial checkpoint, missing weight shard(s) {', '.join(missing)}")
        return [path / n for n in names]
    if (path / WEIGHTS_NAME).is_file():
        return [path / WEIGHTS_NAME]
    found = sorted(path.glob("*.safetensors"))
    found = [f for f in found if f.name not in ("optimizer.safetensors",)]
    if not found:
        raise UserError(f"{path}: no model weights (model.safetensors or {INDEX_NAME})")
    return found


def read_tensors(path: Path) -> Dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    tensors: Dict[str, np.ndarray] = {}
    for f in weight_files(path):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{f}: unreadable or truncated safetensors file ({exc})") from None
    return tensors


def is_quantized(path: Path) -> bool:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return (cfg.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD


def load_quantized(path: str, kernels: str = "auto") -> paddle.nn.Layer:
    """A CausalLM with int8 buffers from a quantised hf export."""
    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import read_hf_config

    p = Path(path)
    arch = read_hf_config(str(p))
    qc = arch.extra.get("quantization_config") or {}
    if qc.get("quant_method") != QUANT_METHOD:
        raise UserError(f"{p}: quantization_config.quant_method is not {QUANT_METHOD!r}")
    model = build(arch, kernels=kernels)
    make_quantized_skeleton(model, list(qc.get("linear", [])), list(qc.get("embedding", [])))
    tensors = read_tensors(p)
    needed = []
    for name in list(qc.get("linear", [])) + list(qc.get("embedding", [])):
        needed += [f"{name}.weight", f"{name}.{SCALE_SUFFIX}"]
    params = dict(model.named_parameters())
    missing = [k for k in needed + list(params) if k not in tensors]
    if missing:
        raise UserError(f"{p}: partial quantised export, missing tensors {missing[:5]}")
    for name in qc.get("linear", []):
        layer = _sublayer(model, name)
        layer.set_quantized(
            np.ascontiguousarray(tensors[f"{name}.weight"].T), tensors[f"{name}.{SCALE_SUFFIX}"]
        )
    for name in qc.get("embedding", []):
        layer = _sublayer(model, name)
        layer.set_quantized(tensors[f"{name}.weight"], tensors[f"{name}.{SCALE_SUFFIX}"])
    linear_modules = {n for n, m in model.named_sublayers() if isinstance(m, paddle.nn.Linear)}
    for name, param in params.items():
        arr = tensors[name]
        if name.rsplit(".", 1)[0] in linear_modules and arr.ndim == 2:
            arr = arr.T
        if tuple(arr.shape) != tuple(param.shape):
            raise UserError(
                f"{p}: tensor {name} has shape {list(arr.shape)}, the model needs {list(param.shape)}"
            )
        param.set_value(np.ascontiguousarray(arr).astype(np.float32))
    model.eval()
    return model
