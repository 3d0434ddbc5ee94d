"""Which linear layers of a model a quantization config stores low-bit: every ``nn.Linear`` whose dotted
name has no component in ``skip_modules`` (by default the embeddings, the LM head, norms and MoE routers;
norms are not linear layers). Taken out of ``skip_modules``, the input embedding and the LM head are
stored in int8 (quant/vocab.py)."""

from __future__ import annotations

from typing import Iterable

HEAD_NAME = "lm_head"
EMBED_NAME = "embed_tokens"


def is_skipped(name: str, skip_modules: Iterable[str]) -> bool:
    """True when one of ``skip_modules`` is a component, or a run of components, of the dotted ``name``
    (``layers.0`` skips ``model.layers.0.self_attn.q_proj``, ``proj`` skips nothing)."""
    parts = name.split(".")
    for skip in skip_modules:
        want = skip.split(".")
        if any(parts[i : i + len(want)] == want for i in range(len(parts) - len(want) + 1)):
            return True
    return False
