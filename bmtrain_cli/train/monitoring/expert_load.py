"""The load of a mixture of experts' routers, for monitoring: each sparse layer's tokens per expert over a
training step (summed over its micro-batches; every routed row, padding included), as metrics
``expert_load/max/layer_{i}`` (the busiest expert's tokens), ``expert_load/mean/layer_{i}`` (tokens per
expert on average: tokens x top-k / experts) and ``expert_load/top_share/layer_{i}`` (the busiest
expert's tokens over the layer's tokens). A router that sends more than :data:`COLLAPSE_SHARE` of a
layer's tokens to one expert has collapsed: the metrics writer warns (train/monitoring/metrics.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

COLLAPSE_SHARE = 0.9
TOP_SHARE = "expert_load/top_share/"


def add_loads(loads: Optional[Dict[int, np.ndarray]], model: Any) -> Optional[Dict[int, np.ndarray]]:
    """``loads`` plus the tokens per expert of each sparse layer's last forward (None: no sparse layer)."""
    for i, layer in enumerate(getattr(model, "layers", [])):
        counts: List[int] = getattr(getattr(layer, "mlp", None), "last_counts", [])
        if counts:
            loads = {} if loads is None else loads
            loads[i] = loads.get(i, 0) + np.asarray(counts, dtype=np.int64)
    return loads


def load_metrics(loads: Dict[int, np.ndarray], top_k: int) -> Dict[str, float]:
    """The step's ``expert_load/*`` metrics from the summed tokens per expert of each sparse layer."""
    out: Dict[str, float] = {}
    for i, counts in sorted(loads.items()):
        tokens = float(counts.sum()) / max(top_k, 1)
        out[f"expert_load/max/layer_{i}"] = float(counts.max())
        out[f"expert_load/mean/layer_{i}"] = float(counts.mean())
        out[f"{TOP_SHARE}layer_{i}"] = float(counts.max()) / tokens if tokens else 0.0
    return out


def collapsed_layers(values: Dict[str, Any]) -> List[str]:
    """The layers (``layer_{i}``) of a step's metrics whose busiest expert took more than COLLAPSE_SHARE
    of their tokens; not where the top k send every expert that share anyway (top-k / experts above it)."""
    out = []
    for key, share in values.items():
        if not key.startswith(TOP_SHARE) or not isinstance(share, float) or share <= COLLAPSE_SHARE:
            continue
        layer = key[len(TOP_SHARE) :]
        busiest, mean = values.get(f"expert_load/max/{layer}"), values.get(f"expert_load/mean/{layer}")
        if busiest and mean is not None and mean / busiest * share <= COLLAPSE_SHARE:
            out.append(layer)
    return out
