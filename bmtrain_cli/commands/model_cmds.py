"""`bmtrain generate` and `bmtrain eval`: use a Hugging Face-style model directory directly."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Optional, Tuple

import typer

from bmtrain_cli.commands.common import user_errors
from bmtrain_cli.errors import UserError

MODEL_HELP = (
    "Model directory: config.json + *.safetensors + tokenizer files (e.g. a checkpoint), or a "
    "bmtrain export (paddle-inference or hf, INT8 too)."
)


def _load(model_path: Path, tokenizer_path: Optional[Path], dtype: str) -> Tuple[Any, Any]:
    if not model_path.exists():
        raise UserError(f"--model_path {model_path} does not exist")
    if not model_path.is_dir():
        raise UserError(f"--model_path {model_path} is not a directory")
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.hf import is_quantized, load_quantized
    from bmtrain_cli.export.loading import is_paddle_inference_export, load_for_inference, resolve_checkpoint
    from bmtrain_cli.lora.adapter_store import is_lora_checkpoint
    from bmtrain_cli.models import load_pretrained

    if dtype in ("bfloat16", "float16"):
        from bmtrain_cli.config.env import paddle_has_gpu

        if not paddle_has_gpu(import_paddle=True):
            raise UserError(
                f"--dtype {dtype} needs a GPU: Paddle's CPU build has no {dtype} matmul or norm kernels; "
                "use --dtype float32 here"
            )
    if (model_path / "checkpoints").is_dir() or (model_path / "latest").exists():
        model_path = resolve_checkpoint(str(model_path))  # a run's output_dir or checkpoints dir: the latest
    tok_src = tokenizer_path or model_path
    try:
        tokenizer = load_tokenizer(str(tok_src))
    except UserError as exc:
        raise UserError(f"{exc} (pass --tokenizer_path if the tokenizer lives elsewhere)") from None
    if is_paddle_inference_export(model_path):  # bmtrain export --format paddle-inference
        model = load_for_inference(str(model_path))
    elif is_lora_checkpoint(model_path):  # LoRA adapters (+ the recorded base): merged for inference
        from bmtrain_cli.lora.adapter_store import load_lora_checkpoint

        model = load_lora_checkpoint(model_path, merge=True, dtype=dtype)
    elif is_quantized(model_path):  # bmtrain export --format hf --quantize int8
        model = load_quantized(str(model_path))
    else:
        from bmtrain_cli.models.arch import read_hf_config
        from bmtrain_cli.plan.estimator import check_arch_fits

        check_arch_fits(read_hf_config(str(model_path)), 2 if dtype in ("bfloat16", "float16") else 4)
        model = load_pretrained(model_path, dtype=dtype)
    if tokenizer.vocab_size > model.arch.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{model.arch.vocab_size}: they do not belong together"
        )
    return model, tokenizer


def _is_static(model: Any) -> bool:
    """A paddle-inference export (logits only: no KV cache, no loss_sum)."""
    return getattr(model, "predictor", None) is not None


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @user_errors
    def generate_cmd(
        model_path: Path = typer.Option(..., "--model_path", "--model-path", help=MODEL_HELP),
        prompt: str = typer.Option(..., "--prompt", help="Prompt text."),
        max_new_tokens: int = typer.Option(64, "--max_new_tokens", "--max-new-tokens", min=1),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy decoding."),
        top_p: float = typer.Option(
            1.0, "--top_p", "--top-p", min=0.0, max=1.0, help="Nucleus sampling mass; 0 = greedy."
        ),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the chat template."),
        template: str = typer.Option("auto", "--template", help="With --chat: auto or a built-in name."),
        seed: int = typer.Option(0, "--seed", min=0, help="Sampling seed (0 or more)."),
        tokenizer_path: Optional[Path] = typer.Option(None, "--tokenizer_path", "--tokenizer-path"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    ) -> None:
        """Generate text from a prompt (KV-cached incremental decoding)."""
        from bmtrain_cli.models.generate import generate

        model, tok = _load(model_path, tokenizer_path, dtype)
        if chat:
            from bmtrain_cli.data.encode import encode_prompt

            # the prompt part of a one-turn instruction record (the answer placeholder is dropped)
            ids, _ = encode_prompt({"input": prompt, "output": "-"}, tok, template, "input_output")
        else:
            ids = tok.encode(prompt)
            if getattr(tok, "add_bos", False) and tok.bos_id is not None:
                ids = [tok.bos_id, *ids]
        if not ids:
            raise UserError("the prompt encodes to no tokens")
        room = model.arch.max_position_embeddings - len(ids)
        if room <= 0:
            raise UserError(
                f"the prompt has {len(ids)} tokens, as many as the model's max_position_embeddings "
                f"({model.arch.max_position_embeddings}): no room for new tokens"
            )
        if max_new_tokens > room:
            typer.echo(
                f"note: --max_new_tokens {max_new_tokens} capped at {room} (max_position_embeddings "
                f"{model.arch.max_position_embeddings} minus the prompt's {len(ids)} tokens)",
                err=True,
            )
            max_new_tokens = room
        t0 = time.perf_counter()
        if _is_static(model):
            from bmtrain_cli.export.loading import generate_static

            new = generate_static(model, [ids], max_new_tokens, temperature, top_p, tok.eos_id, seed)[0]
        else:
            new = generate(model, [ids], max_new_tokens, temperature, top_p, tok.eos_id, seed)[0]
        dt = time.perf_counter() - t0
        text_ids = new[:-1] if new and new[-1] == tok.eos_id else new
        typer.echo(tok.decode(text_ids))
        typer.echo(f"[{len(new)} tokens in {dt:.2f}s, {len(new) / max(dt, 1e-9):.1f} tokens/s]", err=True)

    @app.command("eval")
    @user_errors
    def eval_cmd(
        model_path: Path = typer.Option(..., "--model_path", "--model-path", help=MODEL_HELP),
        data_path: Path = typer.Option(..., "--data_path", "--data-path", help="JSONL file to score."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        batch_size: int = typer.Option(8, "--batch_size", "--batch-size", min=1),
        max_seq_len: Optional[int] = typer.Option(None, "--max_seq_len", "--max-seq-len", min=2),
        template: str = typer.Option("auto", "--template"),
        data_format: str = typer.Option("auto", "--data_format", "--data-format"),
        tokenizer_path: Optional[Path] = typer.Option(None, "--tokenizer_path", "--tokenizer-path"),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    ) -> None:
        """Mean token loss and perplexity over a JSONL file (answers of instruction records, all
        tokens of {"text": ...} records)."""
        from bmtrain_cli.data.encode import encode_scored_file
        from bmtrain_cli.models.scoring import score

        if not data_path.is_file():
            raise UserError(f"--data_path {data_path} does not exist or is not a file")
        model, tok = _load(model_path, tokenizer_path, dtype)
        t0 = time.perf_counter()
        samples = encode_scored_file(
            str(data_path),
            tok,
            template,
            data_format,
            max_len=max_seq_len or model.arch.max_position_embeddings,
        )
        if _is_static(model):
            from bmtrain_cli.models.scoring import score_logits

            result = score_logits(model.logits, samples)
        else:
            result = score(model, samples, batch_size)
        result["seconds"] = round(time.perf_counter() - t0, 3)
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(
                f"loss {result['loss']:.4f}  ppl {result['ppl']:.3f}  "
                f"tokens {result['tokens']}  records {result['records']}"
            )
