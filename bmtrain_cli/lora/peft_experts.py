"""Adapters on a mixture of experts' routed experts in the layout PEFT loads onto transformers 5.x, whose
experts are stacked parameters (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj``
[E, H, I]): PEFT adapts them through ``target_parameters`` (its ``ParamWrapper``), one adapter over all the
experts whose A holds each expert's rows in turn ([E x r, in]) and whose B interleaves them ([out, r x E]:
column j x E + e is expert e's j-th).

Our per-expert adapters on gate_proj and up_proj become one adapter of rank 2r on gate_up_proj (A: gate's
rows over up's; B block-diagonal: gate's outputs from the first r, up's from the last r), with lora_alpha
doubled so the scale alpha / r stays; down_proj's keep rank r. The dense layers' and shared experts' MLP
projections are adapted as parameters too (``gate_proj.weight``...): PEFT turns a ``gate_proj`` in
target_modules of such a model into the stacked experts' and would leave them out. The attention
projections stay in target_modules. Key names as PEFT writes them: the gate_up_proj wrapper is the inner one
(``mlp.experts.base_layer.lora_A.weight``), down_proj's the outer (``mlp.experts.lora_A.weight``)."""

from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

import numpy as np

EXPERT = re.compile(
    r"^(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.lora_(?P<ab>[AB])\.weight$"
)
MLP = ("gate_proj", "up_proj", "down_proj")


def has_expert_adapters(arrays: Dict[str, np.ndarray]) -> bool:
    return any(EXPERT.match(n) for n in arrays)


def _per_layer(arrays: Dict[str, np.ndarray]) -> Dict[str, Dict[Tuple[int, str, str], np.ndarray]]:
    layers: Dict[str, Dict[Tuple[int, str, str], np.ndarray]] = {}
    for name, arr in arrays.items():
        m = EXPERT.match(name)
        if m:
            layers.setdefault(m["layer"], {})[(int(m["e"]), m["proj"], m["ab"])] = np.asarray(arr, np.float32)
    return layers


def _stack(
    pieces: Dict[Tuple[int, str, str], np.ndarray], projs: List[str], rank: int
) -> Tuple[np.ndarray, np.ndarray]:
    """PEFT's (A [E x len(projs) x r, in], B [out_total, len(projs) x r x E]) of one stacked parameter whose
    output is ``projs``' outputs one after the other (ours: A [in, r], B [r, out] per expert)."""
    experts = 1 + max(e for e, _, _ in pieces)
    some = {
        p: next(v for (e, q, ab), v in pieces.items() if q == p and ab == "B")
        for p in projs
        if any(q == p for _, q, _ in pieces)
    }
    width = {p: some[p].shape[1] for p in some}
    fan_in = next(v for (e, q, ab), v in pieces.items() if ab == "A" and q in projs).shape[0]
    outs = [width.get(p, max(width.values())) for p in projs]  # gate and up are equally wide
    r2 = rank * len(projs)
    a = np.zeros((experts, r2, fan_in), np.float32)
    b = np.zeros((sum(outs), r2, experts), np.float32)
    for e in range(experts):
        row = 0
        for i, p in enumerate(projs):
            if (e, p, "A") in pieces:
                a[e, i * rank : (i + 1) * rank] = pieces[(e, p, "A")].T
                b[row : row + outs[i], i * rank : (i + 1) * rank, e] = pieces[(e, p, "B")].T
            row += outs[i]
    return a.reshape(experts * r2, fan_in), b.reshape(sum(outs), r2 * experts)


def peft_expert_layout(
    arrays: Dict[str, np.ndarray], settings: Any, prefix: str
) -> Tuple[Dict[str, np.ndarray], Dict[str, Any]]:
    """(PEFT tensors, adapter_config.json entries) of adapters with some on the routed experts."""
    rank, targets = settings.rank, list(settings.target_modules)
    mlp = [p for p in MLP if p in targets]
    tensors: Dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        if not EXPERT.match(name):
            tensors[prefix + name] = np.ascontiguousarray(np.asarray(arr, np.float32).T)
    gate_up = [p for p in ("gate_proj", "up_proj") if p in mlp]
    for layer, pieces in _per_layer(arrays).items():
        # the stacked parameters' wrappers nest in their order on the module: gate_up_proj inside
        wrapped = [(["gate_proj", "up_proj"], ".base_layer" if "down_proj" in mlp else "")] if gate_up else []
        wrapped += [(["down_proj"], "")] if "down_proj" in mlp else []
        for projs, inner in wrapped:
            a, b = _stack(pieces, projs, rank)
            tensors[f"{prefix}{layer}{inner}.lora_A.weight"] = a
            tensors[f"{prefix}{layer}{inner}.lora_B.weight"] = b
    parameters = ["mlp.experts.gate_up_proj"] if gate_up else []
    parameters += ["mlp.experts.down_proj"] if "down_proj" in mlp else []
    config = {
        "target_modules": [t for t in targets if t not in MLP] or None,
        "target_parameters": parameters + [f"{p}.weight" for p in mlp],
        "rank_pattern": {"mlp.experts.gate_up_proj": 2 * rank} if gate_up else {},
        "alpha_pattern": {"mlp.experts.gate_up_proj": 2 * settings.alpha} if gate_up else {},
    }
    return tensors, config


def mlp_targets(cfg: Dict[str, Any]) -> List[str]:
    """The MLP projections an adapter_config.json written by :func:`peft_expert_layout` adapts."""
    return [p for p in MLP if f"{p}.weight" in (cfg.get("target_parameters") or [])]


def split_expert_layout(tensors: Dict[str, np.ndarray], cfg: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """The inverse of :func:`peft_expert_layout` on PEFT tensors (keys and [out, in] orientation kept):
    each stacked adapter back into per-expert ``mlp.experts.{e}.{proj}.lora_A/B.weight``."""
    mlp = mlp_targets(cfg)
    stacks = [p for p in (["gate_proj", "up_proj"], ["down_proj"]) if set(p) & set(mlp)]
    rank = int(cfg["r"])
    out: Dict[str, np.ndarray] = {}
    fused = re.compile(r"^(?P<layer>.+\.mlp\.experts)(?P<inner>\.base_layer)?\.lora_(?P<ab>[AB])\.weight$")
    for key, arr in tensors.items():
        m = fused.match(key)
        if m is None:
            out[key] = arr
            continue
        projs = stacks[0] if m["inner"] or len(stacks) == 1 else stacks[1]
        r2 = rank * len(projs)
        if m["ab"] == "A":
            a = arr.reshape(-1, r2, arr.shape[1])  # [E, r2, in]
            pieces = {
                (e, i): a[e, i * rank : (i + 1) * rank] for e in range(a.shape[0]) for i in range(len(projs))
            }
        else:
            b = arr.reshape(arr.shape[0], r2, -1)  # [out, r2, E]
            width = arr.shape[0] // len(projs)
            pieces = {
                (e, i): b[i * width : (i + 1) * width, i * rank : (i + 1) * rank, e]
                for e in range(b.shape[2])
                for i in range(len(projs))
            }
        for (e, i), piece in pieces.items():
            if projs[i] in mlp:
                out[f"{m['layer']}.{e}.{projs[i]}.lora_{m['ab']}.weight"] = np.ascontiguousarray(piece)
    return out
