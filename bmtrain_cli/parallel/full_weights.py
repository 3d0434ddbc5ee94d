"""Layout-independent weights: gather tensor-parallel shards and pipeline stages into whole tensors
under the single-process parameter names on save, and split whole tensors into this rank's pieces on load.

A parameter split by fleet's mp layers carries ``is_distributed`` and ``split_axis``; pipeline stages
carry a map from their local parameter names to the single-process names (``pipeline.NAME_MAP_ATTR``).
So a checkpoint saved under tp2 or pp2 is an ordinary Hugging Face checkpoint that loads under tp1/pp1,
in ``models.load_pretrained``, and back under any other layout.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import ParallelCtx, Topology

NAME_MAP_ATTR = "_bmtrain_full_names"
QUANT_NAME_MAP_ATTR = "_bmtrain_quantized_names"  # a stage's quantised layers: {id(layer): full name}


def unwrap(model: Any) -> Any:
    """The user's layer inside fleet/DataParallel wrappers."""
    while hasattr(model, "_layers"):
        model = model._layers
    return model


def local_parameters(model: Any) -> List[Tuple[str, Any]]:
    """(single-process name, parameter) for the parameters this rank holds."""
    inner = unwrap(model)
    names = getattr(inner, NAME_MAP_ATTR, None)
    if names is not None:  # a pipeline stage: only its mapped weights
        return [(names[n], p) for n, p in inner.named_parameters() if n in names]
    return list(inner.state_dict().items())


def _is_split(p: Any) -> bool:
    return bool(getattr(p, "is_distributed", False)) and getattr(p, "split_axis", None) is not None


def full_state_dict(ctx: ParallelCtx, model: Any, dequantize: bool = True) -> Dict[str, np.ndarray]:
    """Whole tensors (Paddle layout, single-process names) on every rank; with ``dequantize`` a quantised
    base's layers too (:func:`dequantized_weights`; without it, as for the adapters alone, none is
    dequantised)."""
    import paddle
    import paddle.distributed as dist

    if ctx.config is not None and ctx.config.parallel.sharding_stage == 3 and ctx.sharding_degree > 1:
        raise UserError("gathering a stage-3 sharded model is done by its wrapper's get_all_parameters()")
    mp_group = ctx.hcg.get_model_parallel_group() if ctx.tp_degree > 1 else None
    local: Dict[str, np.ndarray] = {}
    for name, p in local_parameters(model):
        if _is_split(p) and mp_group is not None:
            parts: List[Any] = []
            dist.all_gather(parts, p.detach(), group=mp_group)
            local[name] = np.concatenate([x.numpy() for x in parts], axis=int(p.split_axis))
        else:
            t = p.detach() if isinstance(p, paddle.Tensor) else p
            local[name] = np.asarray(t.numpy() if hasattr(t, "numpy") else t)
    experts = None
    if ctx.expert_group is not None:  # expert parallel: every rank adds the experts it holds
        from bmtrain_cli.parallel.expert_parallel import is_expert

        held = {n: local[n] for n, p in local_parameters(model) if is_expert(p)}
        if dequantize:  # a quantised base's experts (QLoRA)
            held.update(dequantized_weights(model, mp_group, experts=True))
        shares: List[Any] = []
        dist.all_gather_object(shares, held, group=ctx.expert_group.group)
        for share in shares:
            local.update(share)
        experts = False
    if dequantize:
        local.update(dequantized_weights(model, mp_group, experts))
    if ctx.pp_degree == 1:
        return local
    pieces: List[Any] = []
    dist.all_gather_object(pieces, local, group=ctx.hcg.get_pipe_parallel_group())
    full: Dict[str, np.ndarray] = {}
    for piece in pieces:
        for k, v in piece.items():
            full.setdefault(k, v)  # tied/shared weights appear on several stages: keep the first
    return full


def quantized_names(model: Any) -> Dict[int, str]:
    """{id(layer): single-process name} of a built model's quantised layers, for the pipeline stages
    that will hold them (:func:`dequantized_weights` names their weights by it)."""
    from bmtrain_cli.quant.layer import quantized_layers

    return {id(layer): name for name, layer in quantized_layers(unwrap(model))}


def dequantized_weights(
    model: Any, mp_group: Any = None, experts: Optional[bool] = None
) -> Dict[str, np.ndarray]:
    """The weights a quantised base's layers stand for (QLoRA; they hold codes, not parameters), whole
    (Paddle layout, single-process names): a tensor-parallel shard's gathered over ``mp_group`` along its
    ``split_axis`` (collective). ``experts`` True: only the expert-parallel experts this rank holds;
    False: all but those; None: every layer."""
    import paddle.distributed as dist

    from bmtrain_cli.parallel.expert_parallel import is_expert
    from bmtrain_cli.quant.layer import quantized_layers

    out: Dict[str, np.ndarray] = {}
    inner = unwrap(model)
    full_names = getattr(inner, QUANT_NAME_MAP_ATTR, None)  # a pipeline stage's
    for name, layer in quantized_layers(inner):
        if experts is not None and is_expert(layer) != experts:
            continue
        name = full_names[id(layer)] if full_names is not None else name
        w = layer.dequantized_weight().contiguous()  # the [out, in] codes read as [in, out]
        axis = getattr(layer, "split_axis", None)
        if axis is not None and mp_group is not None:
            parts: List[Any] = []
            dist.all_gather(parts, w, group=mp_group)
            out[f"{name}.weight"] = np.concatenate([x.numpy() for x in parts], axis=int(axis))
        else:
            out[f"{name}.weight"] = w.numpy()
    return out


def load_full_state_dict(ctx: Topology, model: Any, state: Dict[str, Any]) -> None:
    """Copy whole tensors into this rank's parameters, slicing tensor-parallel shards."""
    import paddle

    missing = []
    for name, p in local_parameters(model):
        if name not in state:
            missing.append(name)
            continue
        arr = state[name]
        arr = arr.numpy() if isinstance(arr, paddle.Tensor) else np.asarray(arr)
        if _is_split(p) and ctx.tp_degree > 1:
            axis = int(p.split_axis)
            size = arr.shape[axis] // ctx.tp_degree
            arr = np.take(arr, np.arange(ctx.tp_rank * size, (ctx.tp_rank + 1) * size), axis=axis)
        if tuple(arr.shape) != tuple(p.shape):
            raise UserError(
                f"checkpoint tensor {name} has shape {list(arr.shape)}, the model expects {p.shape}"
            )
        p.set_value(paddle.to_tensor(np.ascontiguousarray(arr)).astype(p.dtype))
    if missing:
        raise UserError(f"checkpoint lacks {len(missing)} weights this model needs, e.g. {missing[:3]}")


class FullWeights:
    """Whole weights with the interface models.save_pretrained reads (arch, state_dict, parameters)."""

    def __init__(self, arch: Any, tensors: Dict[str, np.ndarray]) -> None:
        import paddle

        self.arch = arch
        self._tensors = {k: paddle.to_tensor(v) for k, v in tensors.items()}

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._tensors)

    def parameters(self) -> List[Any]:
        return list(self._tensors.values())


def full_weights_writer(ctx: ParallelCtx, model: Any) -> Any:
    """Gather now (collective); the returned writer saves the whole weights in Hugging Face layout."""
    full = full_state_dict(ctx, model)
    arch = unwrap(model).arch

    def writer(_model: Any, out_dir: str) -> None:
        from bmtrain_cli.models import save_pretrained

        save_pretrained(FullWeights(arch, full), out_dir)

    return writer


def full_model(ctx: ParallelCtx, model: Any, kernels: str = "auto") -> Any:
    """A plain CausalLM with the whole weights (gathered collectively), in eval mode."""

    from bmtrain_cli.lora.inject import is_lora_name, lora_settings
    from bmtrain_cli.lora.split_parts import fuse_adapter_arrays
    from bmtrain_cli.models import build
    from bmtrain_cli.models.hf import hf_state_dict, load_hf_state_dict

    full = full_state_dict(ctx, model)
    inner = unwrap(model)
    plain = build(inner.arch, kernels=kernels)
    # through the Hugging Face layout: parts kept apart under tensor parallel (fused projections, the
    # linear attention's [q; k; v]) are fused there as the one-device model holds them
    base = FullWeights(inner.arch, {k: v for k, v in full.items() if not is_lora_name(k)})
    load_hf_state_dict(plain, hf_state_dict(base), "gathered weights")  # type: ignore[arg-type]
    settings = lora_settings(inner)
    adapters = fuse_adapter_arrays({k: v for k, v in full.items() if is_lora_name(k)}, inner.arch)
    if settings is not None and adapters:
        # LoRA: fold the gathered adapters in, so the copy computes what the trained model does
        from types import SimpleNamespace

        from bmtrain_cli.lora.inject import apply_lora
        from bmtrain_cli.lora.merge import load_adapter_weights, strip_lora

        apply_lora(
            plain,
            SimpleNamespace(
                lora_rank=settings.rank,
                lora_alpha=settings.alpha,
                lora_dropout=0.0,
                lora_target_modules=list(settings.target_modules),
            ),
        )
        load_adapter_weights(plain, adapters, "gathered LoRA adapters")
        strip_lora(plain, merge=True)
    plain.eval()
    return plain
