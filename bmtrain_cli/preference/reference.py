"""The reference model's log-probs: a frozen copy of the starting weights, the policy itself with its LoRA
adapters switched off (no second copy), or numbers computed once before training and cached with the data
(``precompute_ref_log_probs``).

The starting weights are model_config.model_name_or_path (validate-config requires it for stage dpo), so a
resumed run compares against the same reference as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Protocol

import numpy as np
import paddle

from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.preference.logps import sequence_logps


class Reference(Protocol):
    def logps(self, batch: Dict[str, np.ndarray], n_sequences: int) -> paddle.Tensor:
        """Summed response log-probs [n_sequences] of the reference (no gradient)."""


@contextlib.contextmanager
def _inference(model: Any) -> Iterator[None]:
    was_training = model.training
    model.eval()  # no recompute and no dropout for a forward without gradients
    try:
        with paddle.no_grad():
            yield
    finally:
        if was_training:
            model.train()


class FrozenCopy:
    """A second model holding the starting weights, never trained."""

    def __init__(self, model: Any) -> None:
        self.model = model
        for p in model.parameters():
            p.stop_gradient = True
        model.eval()

    def logps(self, batch: Dict[str, np.ndarray], n_sequences: int) -> paddle.Tensor:
        with _inference(self.model):
            return sequence_logps(self.model, batch, n_sequences)[0]


@contextlib.contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The model's LoRA layers compute their base layer alone inside the block."""
    from bmtrain_cli.lora.inject import lora_layers

    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.adapter_enabled = True


class AdaptersOff:
    """LoRA: the policy with its adapters switched off is the frozen base, i.e. the starting model."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def logps(self, batch: Dict[str, np.ndarray], n_sequences: int) -> paddle.Tensor:
        with _inference(self.model), adapters_disabled(self.model):
            return sequence_logps(self.model, batch, n_sequences)[0]


class Precomputed:
    """Reference log-probs read from the batch (``ref_logps``, attached by the loader)."""

    def logps(self, batch: Dict[str, np.ndarray], n_sequences: int) -> paddle.Tensor:
        return paddle.to_tensor(batch["ref_logps"].reshape(-1).astype(np.float64))


def load_reference_model(config: Any, factory: LayerFactory, dtype: Optional[str]) -> Any:
    """The starting weights, loaded again (a frozen copy; tensor-parallel shards under tp)."""
    from bmtrain_cli.models import load_pretrained

    m = config.model
    return load_pretrained(m.model_name_or_path, dtype=dtype, kernels=m.kernels, factory=factory)


def precompute_key(config: Any, dataset: Any) -> str:
    """Names the cached numbers: the data (token caches), the starting weights' bytes and the truncation."""
    from bmtrain_cli.lora.adapter_store import hash_base

    parts = [
        dataset.fingerprint,
        hash_base(config.model.model_name_or_path),
        str(config.model.max_seq_len),
        config.train.truncation,
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def precompute(loader: Any, reference: Reference, key: str, is_main: bool) -> Path:
    """Attach the reference log-probs of every pair of ``loader``'s data set (from the cache beside the
    token cache, or computed now in micro-batches and written there). Collective under tensor parallel:
    every rank computes every pair; only the main rank writes."""
    ds = loader.dataset
    path = Path(ds.stores[0].directory).parent / f"ref_logps-{key}.npy"
    if path.is_file():
        ds.ref_logps = np.load(path)
        if ds.ref_logps.shape == (len(ds), 2):
            return path
    out = np.zeros((len(ds), 2), dtype=np.float64)  # as sequence_logps sums them (fp64)
    ds.ref_logps = None
    for start in range(0, len(ds), loader.micro_batch_size):
        gids = np.arange(start, min(len(ds), start + loader.micro_batch_size))
        batch = loader.batch_of(gids)
        out[gids] = reference.logps(batch, 2 * len(gids)).numpy().reshape(-1, 2)
    if is_main:
        tmp = path.with_suffix(f".tmp{id(out)}.npy")
        np.save(tmp, out)
        tmp.replace(path)
    ds.ref_logps = out
    return path
