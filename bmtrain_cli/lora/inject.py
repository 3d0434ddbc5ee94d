"""Put LoRA adapters on a built model: ``apply_lora(model, train_config) -> names``.

Targets are projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, W_pack) or
``all-linear`` (every projection of the decoder layers; like PEFT, not the LM head). In a mixture of
experts ``gate_proj`` / ``up_proj`` / ``down_proj`` (and ``all-linear``) reach every routed expert's
projection too, each expert with its own adapters, as well as the shared experts and the dense layers. Every other
parameter is frozen (``stop_gradient = True``), so the optimizer, which takes the trainable parameters,
holds no state for them.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Sequence, Tuple, Union

import numpy as np
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.lora.layers import LoRALinear
from bmtrain_cli.lora.split_parts import split_projections, wrap_parts
from bmtrain_cli.models.arch import LORA_PROJECTIONS
from bmtrain_cli.quant.layer import WEIGHTLESS

PROJECTIONS = LORA_PROJECTIONS
ALL_LINEAR = "all-linear"
SETTINGS_ATTR = "lora_settings"
HOOK_ATTR = "_lora_input_grad_hook"


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: Tuple[str, ...]  # the projection names actually wrapped

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d


def _as_list(targets: Union[str, Sequence[str]]) -> List[str]:
    return [targets] if isinstance(targets, str) else list(targets)


def _decoder_projections(model: nn.Layer) -> List[Tuple[str, nn.Layer, str, nn.Layer]]:
    """(full name, parent, attribute, layer) of every projection in the decoder layers."""
    found = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, LoRALinear):
            continue
        for attr in PROJECTIONS:
            child = layer._sub_layers.get(attr)
            if child is not None and (
                isinstance(child, WEIGHTLESS)
                or len(getattr(getattr(child, "weight", None), "shape", [])) == 2
            ):
                found.append((f"{name}.{attr}" if name else attr, layer, attr, child))
    return found


def available_targets(model: nn.Layer) -> List[str]:
    """Projection names this model has (in PROJECTIONS order)."""
    split = split_projections(model)  # fused projections held as their parts (tensor parallel)
    parts = {p for _, _, _, names in split for p in names}
    present = {attr for _, _, attr, _ in _decoder_projections(model)}
    present |= {n.rsplit(".", 1)[-1] for n, layer in model.named_sublayers() if isinstance(layer, LoRALinear)}
    present = (present - parts) | {fused for _, _, fused, _ in split}
    return [p for p in PROJECTIONS if p in present]


def resolve_targets(requested: Union[str, Sequence[str]], model: nn.Layer) -> List[str]:
    """The projection names to wrap; UserError naming the available ones for anything else."""
    names = _as_list(requested)
    if not names:
        raise UserError(
            "train_config.lora_target_modules is empty; name at least one projection or all-linear"
        )
    available = available_targets(model)
    if ALL_LINEAR in names:
        return available
    out: List[str] = []
    for n in names:
        if n in available:
            out.append(n)
        else:
            kind = "unknown target module" if n not in PROJECTIONS else "target module not in this model:"
            raise UserError(
                f"train_config.lora_target_modules: {kind} {n!r}; available: {', '.join(available)}, {ALL_LINEAR}"
            )
    return list(dict.fromkeys(out))


def apply_lora(model: nn.Layer, train_config: Any) -> List[str]:
    """Freeze ``model`` and wrap the configured projections with LoRA adapters; returns the wrapped
    layers' names (e.g. ``model.layers.0.self_attn.q_proj``). Reads lora_rank, lora_alpha, lora_dropout
    and lora_target_modules from ``train_config``."""
    rank = int(train_config.lora_rank)
    if rank <= 0:
        raise UserError(f"train_config.lora_rank must be > 0 (got {rank}; typical values: 8, 16, 64)")
    dropout = float(getattr(train_config, "lora_dropout", 0.0))
    alpha = float(train_config.lora_alpha)
    if getattr(model, SETTINGS_ATTR, None) is not None:
        raise UserError("LoRA adapters are already applied to this model")
    targets = resolve_targets(train_config.lora_target_modules, model)
    for p in model.parameters():
        p.stop_gradient = True
    wrapped = []
    seed = int(getattr(train_config, "seed", 0) or 0)

    def wrap(full: str, layer: nn.Layer) -> LoRALinear:
        lora = LoRALinear(layer, rank, alpha, dropout)
        # A from (seed, layer name) alone: the same adapters under every tensor-parallel degree
        lora.reset_lora_parameters(np.random.default_rng([seed, zlib.crc32(full.encode("utf-8"))]))
        return lora

    split = split_projections(model)
    held_as_parts = {(id(parent), p) for _, parent, _, parts in split for p in parts}
    for full, parent, attr, layer in _decoder_projections(model):
        if attr in targets and (id(parent), attr) not in held_as_parts:
            setattr(parent, attr, wrap(full, layer))
            wrapped.append(full)
    for full, parent, fused, parts in split:
        if fused in targets:  # one adapter on the parts, named and drawn as the fused projection's
            wrap_parts(parent, parts, functools.partial(wrap, full))
            wrapped.append(full)
    if not wrapped:
        raise UserError(f"LoRA: no layer matched {targets}")
    embed = getattr(model, "embed_tokens", None)
    if isinstance(embed, nn.Layer):
        # With the embeddings frozen, the decoder's input needs no gradient, and Paddle's recompute then
        # skips the backward of a checkpointed layer entirely (adapters inside would get no gradient).
        handle = embed.register_forward_post_hook(_output_requires_grad)
        object.__setattr__(model, HOOK_ATTR, handle)
    object.__setattr__(model, SETTINGS_ATTR, LoRASettings(rank, alpha, dropout, tuple(targets)))
    return wrapped


def _output_requires_grad(layer: nn.Layer, inputs: Any, output: Any) -> Any:
    if layer.training and getattr(output, "stop_gradient", False):
        output.stop_gradient = False
    return output


def lora_layers(model: nn.Layer) -> List[Tuple[str, LoRALinear]]:
    return [(n, m) for n, m in model.named_sublayers() if isinstance(m, LoRALinear)]


def lora_settings(model: nn.Layer) -> Any:
    """The LoRASettings of a model with adapters (None without)."""
    return getattr(model, SETTINGS_ATTR, None)


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def trainable_count(model: nn.Layer) -> int:
    """Number of trainable (not frozen) parameter elements."""
    return sum(int(p.numel()) for p in model.parameters() if not p.stop_gradient)
