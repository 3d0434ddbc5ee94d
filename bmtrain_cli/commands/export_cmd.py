"""`bmtrain export`: a training checkpoint -> Paddle Inference model or Hugging Face directory."""

from __future__ import annotations

from typing import Optional

import typer

from bmtrain_cli.commands.common import user_errors


@user_errors
def export(
    checkpoint: str = typer.Option(
        ..., "--checkpoint", "-c", help="A step-N checkpoint, a checkpoints directory or a run's output_dir."
    ),
    output: str = typer.Option(..., "--output", "-o", help="Directory to write the export into."),
    fmt: Optional[str] = typer.Option(
        None,
        "--format",
        "-f",
        help="paddle-inference (default), hf, or gguf (llama.cpp/Ollama: model.gguf + Modelfile); with "
        "--no-merge: the PEFT layout.",
    ),
    quantize: Optional[str] = typer.Option(
        None,
        "--quantize",
        "-q",
        help="int8: weight-only INT8, per-output-channel symmetric scales. With --format gguf: f16 "
        "(default), bf16, q8_0 or q4_0.",
    ),
    eval_data: Optional[str] = typer.Option(
        None,
        "--eval_data",
        "--eval-data",
        help="Held-out JSONL to measure the eval-loss change of --quantize (default: the run's eval data).",
    ),
    template: str = typer.Option(
        "auto",
        "--template",
        help="The prompt template the run trained with, when the tokenizer has no chat template: encodes "
        "--eval_data and, with --format gguf, becomes the Ollama Modelfile's TEMPLATE (auto: the "
        "tokenizer's chat template, else plain).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory."),
    merge: bool = typer.Option(
        True,
        "--merge/--no-merge",
        help="LoRA checkpoints: merge the adapters into the base (default), or write them alone in the "
        "Hugging Face PEFT layout (adapter_config.json + adapter_model.safetensors).",
    ),
    quantize_embeddings: bool = typer.Option(
        True, "--quantize-embeddings/--no-quantize-embeddings", help="With --quantize: embeddings too."
    ),
    max_eval_records: int = typer.Option(
        200, "--max-eval-records", min=1, help="Records used for eval loss."
    ),
) -> None:
    """Export a checkpoint for serving (Paddle Inference), the Hugging Face ecosystem or llama.cpp/Ollama (GGUF)."""
    from bmtrain_cli.export.pipeline import describe, export_checkpoint

    result = export_checkpoint(
        checkpoint,
        output,
        fmt=fmt,
        quantize=quantize,
        eval_data=eval_data,
        overwrite=overwrite,
        quantize_embeddings=quantize_embeddings,
        max_eval_records=max_eval_records,
        template=template,
        merge=merge,
        log=lambda m: typer.echo(m, err=True),
    )
    for line in describe(result):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
