"""Which implementation each fused op runs for ``model_config.kernels``: one resolution, :func:`resolve`,
that the model (``ops.select``) and the memory plan (plan/activations.py) both call.

The static order takes, op by op, our kernel where built, else Paddle's fused op where the device has
one, else the pure-Paddle reference (``custom`` and ``paddle`` draw from fewer sources, ``reference``
from one). ``auto`` on a CPU in one process times the candidates on the model's shapes instead
(ops/measure.py) and records the choice in a small JSON file (``record_path()``: ``$BMTRAIN_KERNEL_CHOICES``,
else ``choices.json`` beside the kernel builds), keyed by the device, Paddle's version, the kernel build
and the op shapes. Later runs with the same key read the record instead of timing again, and so does
`bmtrain plan`, which never times: without a record it counts the static order and says so (the choice
``unmeasured``). A record that cannot be read is ignored with a warning (the run times again and writes
it anew). No Paddle import here: the planner uses this module without training.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from bmtrain_cli.errors import NoticeWarning

OP_NAMES = ("rms_norm", "rotary", "swiglu", "linear_cross_entropy", "cross_entropy_sum")
MODES = ("auto", "custom", "paddle", "reference")
# Paddle's built-in fused ops by device (ops/paddle_fused.py; none fuses the LM head with its loss): the
# Paddle 3.3 CPU wheel has CPU kernels for swiglu and softmax_with_cross_entropy only
PADDLE_FUSED_GPU = ("rms_norm", "rotary", "swiglu", "cross_entropy_sum")
PADDLE_FUSED_CPU = ("swiglu", "cross_entropy_sum")

Layers = List[Tuple[str, Tuple[str, ...]]]  # (source, the ops it provides), in the static order
Picks = Dict[str, Tuple[str, Dict[str, float]]]  # op -> (source, {candidate source: seconds})


class KernelChoiceWarning(NoticeWarning):
    """The record of measured kernel choices could not be read or written; the run times the ops again."""


@dataclass(frozen=True)
class OpShapes:
    """What the op timings (and the record's key) need from a model's architecture."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @classmethod
    def of(cls, arch: Any) -> OpShapes:
        a = arch
        return cls(
            hidden=int(a.hidden_size),
            heads=int(a.num_attention_heads),
            kv_heads=int(a.num_key_value_heads),
            head_dim=int(a.head_dim),
            ffn=int(a.intermediate_size),
            vocab=int(a.vocab_size),
            tied=bool(a.tie_word_embeddings),
        )


@dataclass(frozen=True)
class KernelChoice:
    """op -> source ("custom", "paddle", "reference") and how it was decided: ``static`` (the static
    order; no timing applies), ``recorded`` (a previous run's measured choice), ``measured`` (timed now),
    ``unmeasured`` (auto on a CPU with no record yet and nothing timed: the static order, which the run
    will time)."""

    sources: Dict[str, str]
    origin: str
    timings: Dict[str, Dict[str, float]] = field(default_factory=dict, compare=False)


def layers(mode: str, device: str, custom_ops: Tuple[str, ...]) -> Layers:
    """The sources ``mode`` draws from on ``device`` in the static order; ``custom_ops``: the ops our
    kernels provide there (all when built, the launch-checked ones on a GPU, none without a build)."""
    if mode not in MODES:
        raise ValueError(f"unknown kernels mode {mode!r} (choose one of {', '.join(MODES)})")
    fused = PADDLE_FUSED_GPU if device.startswith("gpu") else PADDLE_FUSED_CPU
    ref: Layers = [("reference", OP_NAMES)]
    if mode == "reference":
        return ref
    if mode == "paddle":
        return [("paddle", fused)] + ref
    if mode == "custom":
        return [("custom", OP_NAMES)]
    return ([("custom", custom_ops)] if custom_ops else []) + [("paddle", fused)] + ref


def static_sources(candidates: Layers) -> Dict[str, str]:
    """Each op's first source in the static order."""
    out: Dict[str, str] = {}
    for source, ops in candidates:
        for op in ops:
            out.setdefault(op, source)
    return out


def measuring(mode: str, device: str, shapes: Optional[OpShapes], processes: int) -> bool:
    """Whether ``auto`` decides by timing: on a CPU, given the shapes, in one process (the ranks of a job
    must run the same ops, and each rank timing for itself could disagree), unless
    ``BMTRAIN_KERNEL_CHOICE=static``."""
    static = os.environ.get("BMTRAIN_KERNEL_CHOICE", "measure") == "static"
    return (
        mode == "auto" and shapes is not None and device.startswith("cpu") and processes <= 1 and not static
    )


def resolve(
    mode: str,
    device: str,
    shapes: Optional[OpShapes],
    custom_ops: Tuple[str, ...],
    processes: int = 1,
    measure: Optional[Callable[[Dict[str, str]], Picks]] = None,
) -> KernelChoice:
    """The implementation of each op for ``mode`` on ``device`` (for the model's ``shapes`` in a job of
    ``processes`` ranks). Where ``auto`` decides by timing: the record's choice for the key, else
    ``measure(static sources)`` (the run; the result is recorded), else the static order marked
    ``unmeasured`` (the planner)."""
    candidates = layers(mode, device, custom_ops)
    static = static_sources(candidates)
    if shapes is None or not measuring(mode, device, shapes, processes):
        return KernelChoice(static, "static")
    key = record_key(device, shapes, candidates)
    recorded = read_record().get(key)
    if isinstance(recorded, dict) and _valid(recorded, candidates):
        return KernelChoice(dict(static, **recorded), "recorded")
    if measure is None:
        return KernelChoice(static, "unmeasured")
    picks = measure(static)
    sources = dict(static, **{op: src for op, (src, _) in picks.items()})
    write_record(key, sources)
    return KernelChoice(sources, "measured", {op: t for op, (_, t) in picks.items()})


def _valid(recorded: Dict[str, Any], candidates: Layers) -> bool:
    """A recorded choice names, for some ops, a source the candidates offer for it."""
    if not recorded:
        return False
    offered = {src: set(ops) for src, ops in candidates}
    return all(op in offered.get(src, ()) for op, src in recorded.items())


# ----------------------------------------------------------------------------- the record


def record_path() -> Path:
    explicit = os.environ.get("BMTRAIN_KERNEL_CHOICES")
    if explicit:
        return Path(explicit)
    from bmtrain_cli.ops.build import cache_root

    return cache_root() / "choices.json"


@cache
def _machine(device: str, custom: bool) -> str:
    """Paddle's version and, where our kernels take part, their build key (sources, flags, compiler,
    CPU flags: ops/build.py)."""
    import paddle

    from bmtrain_cli.ops import build

    kernels = build.build_key(*build.plan()[:3]) if custom else "no-kernels"
    return f"{device.split(':')[0]} paddle {paddle.__version__} kernels {kernels}"


def record_key(device: str, shapes: OpShapes, candidates: Layers) -> str:
    s = shapes
    dims = f"h{s.hidden} q{s.heads} kv{s.kv_heads} d{s.head_dim} f{s.ffn} v{s.vocab} tied{int(s.tied)}"
    sources = ",".join(f"{src}:{len(ops)}" for src, ops in candidates)
    return f"{_machine(device, any(src == 'custom' for src, _ in candidates))} | {dims} | {sources}"


_read: Dict[
    str, Any
] = {}  # path -> (mtime_ns, size, entries): the planner resolves once per layer and layout


def read_record() -> Dict[str, Any]:
    path = record_path()
    try:
        stat = path.stat()
    except OSError:
        return {}
    stamp = (str(path), stat.st_mtime_ns, stat.st_size)
    if _read.get("stamp") == stamp:
        return _read["entries"]
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"ignoring the kernel choice record {path} ({exc}); kernels: auto times the ops again",
            KernelChoiceWarning,
            stacklevel=3,
        )
        entries = {}
    _read.update(stamp=stamp, entries=entries)
    return entries


def write_record(key: str, sources: Dict[str, str]) -> None:
    """Add one choice to the record (written to a temporary file, then moved into place)."""
    path = record_path()
    entries = dict(read_record(), **{key: sources})
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(
            f"could not record the kernel choice in {path} ({exc})", KernelChoiceWarning, stacklevel=3
        )
