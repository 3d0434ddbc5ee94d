"""LoRA on a fused projection that tensor parallel holds as its parts.

Under tensor parallel a fused projection is held as its parts, each split by columns over the ranks:
Qwen3.5's linear-attention ``in_proj_qkv`` ([q; k; v], models/linear_attention.py) as ``in_proj_q/k/v``,
Baichuan's ``W_pack`` and Phi-3's ``qkv_proj`` as ``q_proj/k_proj/v_proj``, Phi-3's and GLM-4's
``gate_up_proj`` as ``gate_proj/up_proj`` (models/blocks.py). The one-device adapter of the fused
projection is A [in, r] and B [r, sum of the parts]. On the parts it is that same A, one parameter shared
by the wrappers (drawn from the fused layer's name, so it is the one-device A), and B cut into the parts'
columns, each split over the ranks like its part: the parts compute the one-device adapter's function,
and A's gradient is the sum of the parts' (each whole after its ``c_identity``). Checkpoints hold the
fused adapter under the transformers module's name (PEFT's layout): :func:`fuse_adapter_arrays` on the way
out, :func:`split_adapter_arrays` on the way in.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np
from paddle import nn

from bmtrain_cli.models.linear_attention import QKV_PARTS

_LINEAR_QKV = tuple(f"in_proj_{p}" for p in QKV_PARTS)


def split_map(arch: Any) -> Dict[str, Tuple[str, ...]]:
    """{fused projection: its parts under tensor parallel, in the fused output's order} of ``arch``."""
    out: Dict[str, Tuple[str, ...]] = {}
    if getattr(arch, "fused_qkv", False):
        out[str(arch.qkv_name)] = ("q_proj", "k_proj", "v_proj")
    if getattr(arch, "fused_gate_up", False):
        out["gate_up_proj"] = ("gate_proj", "up_proj")
    if getattr(arch, "linear_attention", None) is not None:
        out["in_proj_qkv"] = _LINEAR_QKV
    return out


def split_projections(model: nn.Layer) -> List[Tuple[str, nn.Layer, str, Tuple[str, ...]]]:
    """(full fused name, parent, fused attribute, part attributes) of every fused projection that this
    model (its ``arch`` says which it fuses) holds as its parts."""
    fusions = split_map(getattr(model, "arch", None))
    found = []
    for name, layer in model.named_sublayers(include_self=True) if fusions else []:
        held = layer._sub_layers
        for fused, parts in fusions.items():
            if fused not in held and all(p in held for p in parts):
                found.append((f"{name}.{fused}" if name else fused, layer, fused, parts))
    return found


def wrap_parts(parent: nn.Layer, parts: Tuple[str, ...], wrap: Callable[[nn.Layer], Any]) -> None:
    """Replace each part by ``wrap(part)`` (a LoRALinear), the later ones sharing the first one's A."""
    first = None
    for attr in parts:
        lora = wrap(getattr(parent, attr))
        if first is None:
            first = lora
        else:
            lora.lora_A = first.lora_A
        setattr(parent, attr, lora)


def fuse_adapter_arrays(arrays: Dict[str, np.ndarray], arch: Any) -> Dict[str, np.ndarray]:
    """Whole adapter arrays (our names, [in, out]) with the parts' adapters as the fused projection's
    (the fused projections of ``arch``): A once, B the parts' B side by side."""
    out = dict(arrays)
    for fused, parts in split_map(arch).items():
        suffix = f".{parts[0]}.lora_A.weight"
        for name in [n for n in arrays if n.endswith(suffix)]:
            prefix = name[: -len(suffix)]
            for p in parts:
                out.pop(f"{prefix}.{p}.lora_A.weight", None)
            b = [out.pop(f"{prefix}.{p}.lora_B.weight") for p in parts]
            out[f"{prefix}.{fused}.lora_A.weight"] = arrays[name]
            out[f"{prefix}.{fused}.lora_B.weight"] = np.concatenate(b, axis=1)
    return out


def split_adapter_arrays(model: nn.Layer, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The inverse of :func:`fuse_adapter_arrays` for the fused projections ``model`` (with adapters)
    holds as parts: each part gets A and its columns of B (whole; the loader slices this rank's)."""
    out = dict(arrays)
    for full, parent, _, parts in split_projections(model):
        a, b = out.pop(f"{full}.lora_A.weight", None), out.pop(f"{full}.lora_B.weight", None)
        if a is None or b is None:
            continue
        prefix = full.rsplit(".", 1)[0] + "." if "." in full else ""
        sizes = [int(getattr(parent, p).out_features) for p in parts]
        for p, piece in zip(parts, np.split(b, np.cumsum(sizes)[:-1], axis=1)):
            out[f"{prefix}{p}.lora_A.weight"] = a
            out[f"{prefix}{p}.lora_B.weight"] = piece
    return out
