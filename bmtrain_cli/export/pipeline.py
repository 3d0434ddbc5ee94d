"""`bmtrain export` end to end: resolve and check the checkpoint, load it, optionally quantise (measuring
the held-out loss before and after), write the chosen format into a temporary directory and move it into
place, so that a failed export never leaves a half-written output behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from bmtrain_cli.checkpoint_layout import CHECKPOINTS_DIR, LATEST, STATE_FILE, atomic_directory
from bmtrain_cli.errors import UserError, writes_to
from bmtrain_cli.export.meta import ExportResult, write_export_meta

FORMATS = ("paddle-inference", "hf", "gguf")
QUANTIZE = ("int8",)  # paddle-inference and hf; gguf takes gguf_export.GGUF_QUANTIZE
_ALIASES = {"paddle_inference": "paddle-inference", "paddle": "paddle-inference", "huggingface": "hf"}


def normalize_format(fmt: str) -> str:
    f = _ALIASES.get(fmt.strip().lower(), fmt.strip().lower())
    if f not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    return f


def check_output(output: str, overwrite: bool) -> Path:
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"output {output} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(
            f"output directory {output} already exists and is not empty; pass --overwrite to replace it"
        )
    return out


def refuse_training_output(out: Path, ckpt: Path) -> None:
    """An export never goes into the checkpoint it reads, a directory above or inside it, or a directory
    holding training state (a step-N checkpoint, a checkpoints directory, a run's output_dir): with
    --overwrite it would delete the optimizer state and trainer_state.json a resume needs."""
    o, c = out.resolve(), ckpt.resolve()
    if o == c or o in c.parents or c in o.parents:
        raise UserError(
            f"--output {out} is, holds or lies inside the checkpoint being exported ({ckpt}); choose a "
            "directory outside the run, e.g. exports/"
        )
    if o.is_dir() and (
        (o / STATE_FILE).is_file() or (o / CHECKPOINTS_DIR).is_dir() or (o / LATEST).is_file()
    ):
        raise UserError(
            f"--output {out} holds training state (a checkpoint, a checkpoints directory or a run's "
            "output_dir); export elsewhere, e.g. exports/"
        )


def _eval_data_from_run(ckpt: Path) -> Optional[str]:
    """The held-out file the run that wrote ``ckpt`` evaluated on, when its trainer state records it."""
    state_file = ckpt / STATE_FILE
    if not state_file.is_file():
        return None
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    candidates = [state.get("eval_data_path"), (state.get("config") or {}).get("train_config", {})]
    for c in candidates:
        if isinstance(c, dict):
            c = c.get("eval_data_path")
        if isinstance(c, list):
            c = c[0] if c else None
        if isinstance(c, str) and Path(c).is_file():
            return c
    return None


def _weight_bytes(out: Path, fmt: str) -> int:
    if fmt == "paddle-inference":
        return sum(f.stat().st_size for f in out.glob("*.pdiparams"))
    if fmt == "gguf":
        return sum(f.stat().st_size for f in out.glob("*.gguf"))
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def _format_and_quantize(
    fmt: Optional[str], quantize: Optional[str], merge: bool
) -> Tuple[str, Optional[str]]:
    """The normalised --format and --quantize; UserError for an unknown one or a pair --no-merge cannot do."""
    if not merge and (quantize or (fmt is not None and normalize_format(fmt) != "hf")):
        raise UserError(
            "--no-merge writes the LoRA adapters alone in the Hugging Face PEFT layout (fp32); "
            "--format paddle-inference and --quantize need merged weights: drop --no-merge"
        )
    fmt = normalize_format(fmt or "paddle-inference")
    if fmt == "gguf":
        from bmtrain_cli.export.gguf_export import DEFAULT_GGUF_QUANTIZE, GGUF_QUANTIZE

        q = (quantize or DEFAULT_GGUF_QUANTIZE).lower()
        if q not in GGUF_QUANTIZE:
            raise UserError(
                f"unknown --quantize {quantize!r} for --format gguf; supported: {', '.join(GGUF_QUANTIZE)}"
            )
        return fmt, q
    if quantize is not None and quantize.lower() not in QUANTIZE:
        raise UserError(f"unknown --quantize {quantize!r}; supported: {', '.join(QUANTIZE)}")
    return fmt, (quantize.lower() if quantize else None)


def _write_format(
    tmp: Path,
    fmt: str,
    model: Any,
    tokenizer: Any,
    report: Any,
    source_config: Dict[str, Any],
    ckpt: Path,
    quantize: Optional[str],
    template: str = "auto",
) -> None:
    """The model in ``fmt`` (paddle-inference, hf or gguf) with its config and tokenizer, into ``tmp``."""
    if fmt == "paddle-inference":
        arch: Any = getattr(model, "arch", None)
        if getattr(arch, "num_experts", 0):
            raise UserError(
                f"--format paddle-inference: the {arch.family} mixture of experts does not trace to a static "
                "graph (its dispatch reads the per-expert token counts, as to_static does not allow); "
                "export --format hf"
            )
        from bmtrain_cli.export.hf import write_tokenizer
        from bmtrain_cli.export.paddle_inference import export_paddle_inference

        export_paddle_inference(model, str(tmp), meta={"source": str(ckpt), "quantization": quantize})
        cfg = dict(source_config)
        if report is not None:
            from bmtrain_cli.export.hf import quantization_config

            cfg["quantization_config"] = quantization_config(report)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        write_tokenizer(tokenizer, tmp)
    elif fmt == "gguf":
        from bmtrain_cli.export.gguf_export import write_gguf_export

        write_gguf_export(model, tokenizer, tmp, ckpt, quantize, template)
    else:
        from bmtrain_cli.export.hf import export_hf

        export_hf(model, str(tmp), tokenizer=tokenizer, report=report, source_config=source_config)


def _load_merged(ckpt: Path) -> Tuple[Any, Any]:
    """(the model to export, for a QLoRA checkpoint the quantisation error of its merged weights)."""
    from bmtrain_cli.export.loading import LORA_ADAPTER_CONFIG, load_checkpoint_model

    if (ckpt / LORA_ADAPTER_CONFIG).is_file():
        from bmtrain_cli.lora.adapter_store import merge_checkpoint_measured

        return merge_checkpoint_measured(str(ckpt), kernels="reference")
    return load_checkpoint_model(ckpt, kernels="reference"), None


def export_checkpoint(
    checkpoint: str,
    output: str,
    fmt: Optional[str] = None,
    quantize: Optional[str] = None,
    eval_data: Optional[str] = None,
    overwrite: bool = False,
    quantize_embeddings: bool = True,
    max_eval_records: int = 200,
    template: str = "auto",
    log: Any = print,
    merge: bool = True,
) -> ExportResult:
    """Export ``checkpoint`` to ``output`` (see the module docstring). UserError for anything the user can
    fix: missing/partial checkpoint, unknown format or quantisation, existing output, bad eval data.
    ``fmt`` None means paddle-inference (with ``merge``) or the PEFT adapter layout (without)."""
    fmt, quantize = _format_and_quantize(fmt, quantize, merge)
    from bmtrain_cli.export.loading import check_checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    refuse_training_output(Path(output), ckpt)
    out = check_output(output, overwrite)
    check_checkpoint(ckpt)
    if not merge:  # LoRA: the adapters alone, in PEFT layout (merging is load_checkpoint_model's default)
        from bmtrain_cli.export.peft import export_adapters

        return export_adapters(ckpt, out, log=log)
    if eval_data is not None and not Path(eval_data).is_file():
        raise UserError(f"--eval_data {eval_data} does not exist")
    if eval_data is None and quantize and fmt != "gguf":
        eval_data = _eval_data_from_run(ckpt)

    import paddle

    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.quantize import quantize_model

    tokenizer = load_tokenizer(str(ckpt))
    log(f"loading {ckpt}")
    model, merge_error = _load_merged(ckpt)
    model.eval()
    if any(p.dtype != paddle.float32 for p in model.parameters()):
        model.to(dtype="float32")
    fp32_bytes = sum(int(p.numel()) * 4 for p in model.parameters())
    result = ExportResult(ckpt, out, fmt, quantize, fp32_bytes, 0, eval_data=eval_data)
    if merge_error is not None:
        result.quantized_base = merge_error.to_dict()

    def logits_fn(ids: Any) -> Any:
        with paddle.no_grad():
            return model(paddle.to_tensor(ids)).astype("float32").numpy()

    report = None
    if quantize and fmt != "gguf":  # GGUF types are applied by its writer
        samples = None
        if eval_data:
            from bmtrain_cli.data.encode import encode_eval_file
            from bmtrain_cli.models.scoring import logits_loss

            samples = encode_eval_file(eval_data, tokenizer, template=template, max_records=max_eval_records)
            result.eval_records = len(samples)
            result.eval_loss_fp32 = logits_loss(logits_fn, samples)[0]
        report = quantize_model(model, embeddings=quantize_embeddings)
        result.quantized_linear, result.quantized_embedding = report.linear, report.embedding
        if samples is not None:
            result.eval_loss_quantized = logits_loss(logits_fn, samples)[0]

    if merge_error is not None and merge_error.dtype != "float32":
        model.to(dtype=merge_error.dtype)  # the base's dtype: the merged weights as measured
        if fmt != "hf" or report is not None:
            model.to(dtype="float32")  # those formats are written in fp32 (of the same values)
    source_config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    with writes_to(out), atomic_directory(out, f".{out.name}.tmp-export", create=False) as tmp:
        _write_format(tmp, fmt, model, tokenizer, report, source_config, ckpt, quantize, template)
        result.export_weight_bytes = _weight_bytes(tmp, fmt)
        write_export_meta(
            tmp, {"format": fmt, "source": str(ckpt), "quantization": quantize, "report": result.to_dict()}
        )
    return result


def describe(result: ExportResult) -> List[str]:
    """The lines `bmtrain export` prints."""
    lines = [
        f"exported {result.checkpoint} -> {result.output} ({result.format}"
        + (f", {result.quantize}" if result.quantize else "")
        + ")",
        f"weights: {result.export_weight_bytes / 2**20:.2f} MiB on disk vs {result.fp32_bytes / 2**20:.2f} MiB "
        f"in fp32: size ratio {result.size_ratio:.3f}x",
    ]
    if result.quantized_base:
        from bmtrain_cli.lora.quantized_merge import MergeError

        lines.append(MergeError(**result.quantized_base).describe())
    if result.format == "gguf":
        from bmtrain_cli.export.gguf_export import describe_gguf

        return lines + describe_gguf(result.output)
    if result.quantize:
        lines.append(
            f"quantised to int8 (per-output-channel symmetric scales): {len(result.quantized_linear)} linear "
            f"layers ({', '.join(sorted({n.rsplit('.', 1)[-1] for n in result.quantized_linear}))})"
            + (
                f" and embeddings ({', '.join(result.quantized_embedding)})"
                if result.quantized_embedding
                else ""
            )
            + "; norms and biases stay fp32"
        )
        if result.eval_loss_change is not None:
            lines.append(
                f"eval loss on {result.eval_data} ({result.eval_records} records): fp32 "
                f"{result.eval_loss_fp32:.5f} -> int8 {result.eval_loss_quantized:.5f} "
                f"({result.eval_loss_change * 100:+.3f}% relative)"
            )
        else:
            lines.append("eval loss change: not measured (pass --eval_data FILE with held-out records)")
    return lines
