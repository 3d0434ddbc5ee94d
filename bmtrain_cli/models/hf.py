"""Hugging Face checkpoints in and out: ``build``, ``load_pretrained``, ``save_pretrained``.

Names follow Hugging Face exactly. Paddle's Linear stores weights as [in, out] and Hugging Face as
[out, in], so every matrix except the embedding is transposed on the way in and out. Fused projections
(Baichuan's ``W_pack`` and Phi-3's ``qkv_proj`` holding q/k/v, Phi-3's and GLM-4's ``gate_up_proj``,
Qwen3.5's linear-attention ``in_proj_qkv`` and ``conv1d``) are
kept fused on one device and split into their parts under tensor parallelism.
Under tensor parallelism each rank takes its slice of the full tensor (the axis where the local
parameter is smaller).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, MutableMapping, Optional, Sequence, Tuple, Union

import numpy as np
import paddle

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.arch import ModelArch, arch_from_model_config, arch_to_hf_dict, read_hf_config
from bmtrain_cli.models.decoder import CausalLM
from bmtrain_cli.models.families import family
from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.models.linear_attention import QKV_PARTS
from bmtrain_cli.models.safetensors_io import LazyTensors, checkpoint_files, write_safetensors

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# Buffers some checkpoints carry that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attn.bias", "attn.masked_bias")
# vectors here, [1, n] in checkpoints (ERNIE 4.5 MoE's router score bias)
_VECTORS = ("e_score_correction_bias",)


@contextlib.contextmanager
def _default_dtype(dtype: str) -> Iterator[None]:
    old = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)  # type: ignore[arg-type]  # a name of DTYPES (_check_dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(old)


def _check_dtype(dtype: Optional[str]) -> str:
    dtype = dtype or "float32"
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not one of {DTYPES}")
    return dtype


def build(
    cfg_or_arch: Any,
    *,
    factory: Optional[LayerFactory] = None,
    kernels: str = "auto",
    attention_implementation: Optional[str] = None,
    dtype: Optional[str] = None,
    quantization: Any = None,
) -> CausalLM:
    """A freshly initialised model from a config ``ModelConfig`` or a :class:`ModelArch`; with
    ``quantization`` (model_config.quantization) its linear layers then quantised."""
    if isinstance(cfg_or_arch, ModelArch):
        arch = cfg_or_arch
        attn = attention_implementation or "auto"
    else:
        arch = arch_from_model_config(cfg_or_arch)
        attn = (  # not `or`: mypy types `Optional[str] or Any` as possibly None
            attention_implementation
            if attention_implementation
            else getattr(cfg_or_arch, "attention_implementation", "auto")
        )
        if kernels == "auto":
            kernels = getattr(cfg_or_arch, "kernels", "auto")
    with _default_dtype(_check_dtype(dtype)):
        # the initial weights depend only on the random state at this call, not on the draws the layers
        # make while they are constructed (plain and tensor-parallel layers draw differently)
        state = paddle.get_rng_state()
        model = CausalLM(arch, factory=factory, kernels=kernels, attention_implementation=attn)
        paddle.set_rng_state(state)
        model.init_weights()
    if quantization is not None:
        from bmtrain_cli.quant.layer import quantize_model

        quantize_model(model, quantization, kernels)
    return model


def _is_matrix(name: str, ndim: int) -> bool:
    return ndim == 2 and not name.endswith("embed_tokens.weight")


def _fused_parts(arch: ModelArch, every: bool = False) -> Dict[str, Tuple[Tuple[str, ...], List[int]]]:
    """{fused module path: (its parts' module paths, their output sizes)}: the fused projections this
    architecture's checkpoints hold, or with ``every`` any a checkpoint of these shapes may hold."""
    hd, f = arch.head_dim, arch.intermediate_size
    kv = arch.num_key_value_heads * hd
    qkv = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        [arch.num_attention_heads * hd, kv, kv],
    )
    out: Dict[str, Tuple[Tuple[str, ...], List[int]]] = {}
    for name in ("W_pack", "qkv_proj"):
        if every or (arch.fused_qkv and arch.qkv_name == name):
            out[f"self_attn.{name}"] = qkv
    if every or arch.fused_gate_up:
        out["mlp.gate_up_proj"] = (("mlp.gate_proj", "mlp.up_proj"), [f, f])
    la = arch.linear_attention  # Gated DeltaNet's [q; k; v] projection and convolution
    if la is not None:
        for fused, stem in (("in_proj_qkv", "in_proj"), ("conv1d", "conv1d")):
            parts = tuple(f"linear_attn.{stem}_{p}" for p in QKV_PARTS)
            out[f"linear_attn.{fused}"] = (parts, [la.key_dim, la.key_dim, la.value_dim])
    return out


def _local_slice(full: np.ndarray, local_shape: List[int], factory: LayerFactory, name: str) -> np.ndarray:
    if list(full.shape) == list(local_shape):
        return full
    tp, rank = int(getattr(factory, "tp_degree", 1)), int(getattr(factory, "tp_rank", 0))
    axes = [a for a, (f, l_) in enumerate(zip(full.shape, local_shape)) if f != l_]
    if (
        len(full.shape) != len(local_shape)
        or len(axes) != 1
        or full.shape[axes[0]] != local_shape[axes[0]] * tp
    ):
        raise UserError(
            f"checkpoint tensor {name} has shape {list(full.shape)}, the model expects {local_shape}"
        )
    a, n = axes[0], local_shape[axes[0]]
    return np.take(full, np.arange(rank * n, (rank + 1) * n), axis=a)


def _rename(name: str, renames: Tuple[Tuple[str, str], ...], to_hf: bool) -> str:
    for ours, theirs in renames if to_hf else reversed(renames):
        name = name.replace(ours, theirs) if to_hf else name.replace(theirs, ours)
    return name


def _unfuse_experts(tensors: MutableMapping[str, np.ndarray]) -> None:
    """transformers 5.x's in-memory expert layout (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``mlp.experts.down_proj`` [E, H, I]) as the per-expert tensors the hub's checkpoints hold."""
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        stacked = tensors.pop(name)
        prefix, kind = name.rsplit(".", 1)
        for e, w in enumerate(stacked):
            if kind == "down_proj":
                tensors[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                gate, up = np.split(w, 2, axis=0)
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}.{e}.up_proj.weight"] = up


def load_hf_state_dict(
    model: CausalLM,
    tensors: MutableMapping[str, np.ndarray],
    source: str = "checkpoint",
    take: Optional[Callable[[str, np.ndarray], bool]] = None,
    take_rows: Optional[Callable[[str, Any], bool]] = None,
) -> None:
    """Copy Hugging Face-layout tensors (name -> array; a LazyTensors reads each when it is reached)
    into ``model``, one at a time. ``take(name, array in our layout)``, when given, may keep a tensor
    itself (the quantised layers of bmtrain_cli/quant/layer.py) and return True; the others are copied
    into their parameters (initialised first when the model was built under paddle.LazyGuard).
    ``take_rows(name, (read, shape) or None)`` is asked first for a tensor still in its file, and may keep it
    reading ``read(r0, r1)`` one block of rows at a time (the int8 embedding and head, quant/vocab.py), or
    skip it unread (an expert another expert-parallel rank holds)."""
    arch = model.arch
    renames = family(arch.family).hf_renames
    if renames:
        tensors = {_rename(n, renames, to_hf=False): t for n, t in tensors.items()}
    if arch.num_experts:
        _unfuse_experts(tensors)
    params = model.state_dict()
    # A fused projection in the checkpoint but its parts in the model (tensor parallel): split it.
    for fused, (parts, sizes) in _fused_parts(arch, every=True).items():
        for name in [n for n in tensors if n.rsplit(".", 1)[0].endswith(fused) and n not in params]:
            kind = name.rsplit(".", 1)[1]
            prefix = name[: -len(fused) - len(kind) - 1]
            pieces = np.split(tensors.pop(name), np.cumsum(sizes)[:-1], axis=0)
            for part, piece in zip(parts, pieces):
                tensors[f"{prefix}{part}.{kind}"] = piece
    if arch.tie_word_embeddings and "lm_head.weight" in tensors:
        del tensors["lm_head.weight"]
    missing = [n for n in params if n not in tensors]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise UserError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    unexpected = [n for n in tensors if n not in params and not n.endswith(_IGNORED_SUFFIXES)]
    if unexpected:
        print(
            f"warning: {source}: ignoring {len(unexpected)} unknown tensors ({unexpected[0]}, ...)",
            file=sys.stderr,
        )
    rows = getattr(tensors, "row_reader", None)  # a checkpoint's files, read a block of rows at a time
    for name, param in params.items():
        if take_rows is not None and rows is not None and take_rows(name, rows(name)):
            continue
        arr = tensors[name]
        if _is_matrix(name, arr.ndim):
            arr = arr.T
        if name.endswith(_VECTORS):
            arr = arr.reshape(param.shape)
        arr = _local_slice(arr, list(param.shape), model.factory, name)
        if take is not None and take(name, arr):
            continue
        if not param._is_initialized():  # built lazily (quantised loading)
            param.initialize()
        value = paddle.to_tensor(np.ascontiguousarray(arr, dtype=np.float32)).astype(param.dtype)
        param.set_value(value)


def load_pretrained(
    path: Union[str, Path],
    dtype: Optional[str] = None,
    kernels: str = "auto",
    factory: Optional[LayerFactory] = None,
    attention_implementation: str = "auto",
    quantization: Any = None,
    held_experts: Optional[Callable[[int], Sequence[int]]] = None,
) -> CausalLM:
    """Load a Hugging Face-style directory (config.json + safetensors, sharded or not), one tensor at a
    time; with ``quantization`` (model_config.quantization) its linear layers quantised as they are read.
    ``held_experts(num_experts)``, under expert parallel, names the routed experts this rank holds: a
    quantised load reads and quantises only theirs (the others' projections stand as
    quant/layer.HeldElsewhere until parallel/expert_parallel.shard_experts drops them)."""
    d = Path(path)
    arch = read_hf_config(str(d))
    if not d.is_dir():
        raise UserError(f"{path}: expected a checkpoint directory")
    tensors = LazyTensors(checkpoint_files(d))
    # quantised: the parameters are created lazily, so a layer that is quantised never holds its
    # full-precision weight; each arrives from the file and is quantised at once
    lazy = paddle.LazyGuard() if quantization is not None else contextlib.nullcontext()
    with _default_dtype(_check_dtype(dtype)), lazy:
        model = CausalLM(
            arch, factory=factory, kernels=kernels, attention_implementation=attention_implementation
        )
    take = take_rows = None
    if quantization is not None:
        from bmtrain_cli.quant.layer import Quantizer

        quantizer = Quantizer(model, quantization, kernels, held_experts)
        take, take_rows = quantizer.take, quantizer.take_rows
    load_hf_state_dict(model, tensors, str(d), take=take, take_rows=take_rows)
    model.eval()
    return model


def hf_state_dict(model: CausalLM) -> Dict[str, np.ndarray]:
    """The model's weights in Hugging Face layout and names (numpy, fp32 for half-precision params)."""
    out: Dict[str, np.ndarray] = {}
    bias_row = family(model.arch.family).score_bias_row
    for name, param in model.state_dict().items():
        t = param.detach()
        if t.dtype in (paddle.bfloat16, paddle.float16):
            t = t.astype("float32")
        arr = t.numpy()
        if _is_matrix(name, arr.ndim):
            arr = np.ascontiguousarray(arr.T)
        out[name] = arr.reshape(1, -1) if bias_row and name.endswith(_VECTORS) else arr
    # parts kept apart under tensor parallel are written fused, as the family's checkpoints hold them
    for fused, (parts, _) in _fused_parts(model.arch).items():
        for name in [n for n in list(out) if n.rsplit(".", 1)[0].endswith(parts[0])]:
            kind = name.rsplit(".", 1)[1]
            prefix = name[: -len(parts[0]) - len(kind) - 1]
            out[f"{prefix}{fused}.{kind}"] = np.concatenate([out.pop(f"{prefix}{p}.{kind}") for p in parts])
    renames = family(model.arch.family).hf_renames  # experts per expert, named as the hub names them
    return {_rename(n, renames, to_hf=True): t for n, t in out.items()} if renames else out


def _dtype_of(model: CausalLM) -> str:
    for p in model.parameters():
        return str(p.dtype).replace("paddle.", "")
    return "float32"


def save_pretrained(
    model: CausalLM, path: Union[str, Path], max_shard_size_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> List[Path]:
    """Write config.json and safetensors weights (sharded with model.safetensors.index.json when the
    weights exceed ``max_shard_size_bytes``). Returns the files written."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    dtype = _dtype_of(model)
    tensors = hf_state_dict(model)
    bf16 = tuple(tensors) if dtype == "bfloat16" else ()
    if dtype == "float16":
        tensors = {k: v.astype(np.float16) for k, v in tensors.items()}
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    shards: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    total = 0
    for name, arr in tensors.items():
        nbytes = arr.size * itemsize
        if shards[-1] and size + nbytes > max_shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += nbytes
        total += nbytes
    written: List[Path] = []
    for stale in list(d.glob("model*.safetensors")) + [d / "model.safetensors.index.json"]:
        if stale.exists():
            stale.unlink()
    if len(shards) == 1:
        f = d / "model.safetensors"
        write_safetensors(f, shards[0], bf16=bf16)
        written.append(f)
    else:
        weight_map: Dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(d / fname, shard, bf16=tuple(n for n in shard if n in bf16))
            weight_map.update({n: fname for n in shard})
            written.append(d / fname)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")
        written.append(d / "model.safetensors.index.json")
    cfg = arch_to_hf_dict(model.arch, dtype)
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    written.append(d / "config.json")
    return written
