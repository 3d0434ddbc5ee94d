"""`bmtrain generate` and `bmtrain eval`: use a Hugging Face-style model directory directly."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import typer

from bmtrain_cli.commands.common import tokenizer_path_option, user_errors
from bmtrain_cli.errors import UserError
from bmtrain_cli.export.any_model import load_model_and_tokenizer

MODEL_HELP = (
    "Model directory: config.json + *.safetensors + tokenizer files (e.g. a checkpoint), or a "
    "bmtrain export (paddle-inference or hf, INT8 too)."
)


def _benchmark(
    model_path: Path,
    task: str,
    data_path: Path,
    num_fewshot: int,
    subjects: Optional[List[str]],
    batch_size: int,
    max_seq_len: Optional[int],
    tokenizer_path: Optional[Path],
    dtype: str,
) -> Dict[str, Any]:
    """`bmtrain eval --task`: a multiple-choice benchmark from local files (docs/eval.md)."""
    from bmtrain_cli.evaluation.layouts import read_task
    from bmtrain_cli.evaluation.progress import Progress
    from bmtrain_cli.evaluation.tasks import evaluate

    found = read_task(task, data_path, subjects)
    model, tok = load_model_and_tokenizer(model_path, tokenizer_path, dtype)
    n = sum(len(q.choices) for s in found for q in s.test)
    progress = Progress(n, f"{task} ({len(found)} subjects, {num_fewshot}-shot)")
    t0 = time.perf_counter()
    result, _ = evaluate(
        task,
        found,
        model,
        tok,
        num_fewshot,
        max_seq_len or model.arch.max_position_embeddings,
        batch_size,
        progress,
    )
    progress.close()
    return {"task": task, "num_fewshot": num_fewshot, **result, "seconds": round(time.perf_counter() - t0, 3)}


def _print_benchmark(result: Dict[str, Any]) -> None:
    for name, s in result["subjects"].items():
        typer.echo(
            f"{name:40s} acc {s['acc']:.4f}  acc_norm {s['acc_norm']:.4f}  ({s['questions']} questions)"
        )
    typer.echo(
        f"{result['task']} ({result['num_fewshot']}-shot): acc {result['acc']:.4f}  acc_norm "
        f"{result['acc_norm']:.4f} over {result['questions']} questions; mean of subjects' acc "
        f"{result['acc_subject_mean']:.4f}"
    )


def _is_static(model: Any) -> bool:
    """A paddle-inference export (logits only: no KV cache, no loss_sum)."""
    return getattr(model, "predictor", None) is not None


def _exact_match(
    model: Any, tok: Any, data_path: Path, template: str, data_format: str, max_new_tokens: int
) -> Dict[str, Any]:
    """Exact-match accuracy of greedy answers over the records that carry a reference answer
    (train/evaluation/answer_accuracy.answer_accuracy, as the quickstart's held-out accuracy); nothing without such records."""
    from bmtrain_cli.data.readers import read_values
    from bmtrain_cli.train.evaluation.answer_accuracy import answer_accuracy

    acc = answer_accuracy(
        model,
        tok,
        read_values(str(data_path)),
        template=template,
        data_format=data_format,
        max_new_tokens=max_new_tokens,
    )
    if not acc["n"]:
        return {}
    return {"exact_match": acc["accuracy"], "exact_match_records": acc["n"]}


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
        tokenizer_path: Optional[Path] = tokenizer_path_option(),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    ) -> None:
        """Generate text from a prompt (KV-cached incremental decoding)."""
        from bmtrain_cli.models.decoding import SamplingOptions
        from bmtrain_cli.models.generate import generate

        model, tok = load_model_and_tokenizer(model_path, tokenizer_path, dtype)
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
        options = SamplingOptions(max_new_tokens, temperature, top_p, tok.eos_id, seed)
        t0 = time.perf_counter()
        if _is_static(model):
            from bmtrain_cli.export.loading import generate_static

            new = generate_static(model, [ids], options)[0]
        else:
            new = generate(model, [ids], options)[0]
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
        batch_size: int = typer.Option(
            8, "--batch_size", "--batch-size", min=1, help="Records scored per batch."
        ),
        max_seq_len: Optional[int] = typer.Option(
            None,
            "--max_seq_len",
            "--max-seq-len",
            min=2,
            help="Truncate longer records (default: the model's).",
        ),
        template: str = typer.Option("auto", "--template", help="auto (the tokenizer's) or a built-in name."),
        data_format: str = typer.Option(
            "auto", "--data_format", "--data-format", help="auto, input_output, alpaca, chat or text."
        ),
        tokenizer_path: Optional[Path] = tokenizer_path_option(),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
        exact_match: bool = typer.Option(
            True,
            "--exact_match/--no_exact_match",
            help="Also decode each record's answer greedily and report the share that equals the reference "
            "(records with an answer, on a checkpoint; the quickstart's held-out accuracy).",
        ),
        max_new_tokens: int = typer.Option(
            32, "--max_new_tokens", "--max-new-tokens", min=1, help="Longest decoded answer for exact match."
        ),
        task: Optional[str] = typer.Option(
            None,
            "--task",
            help="A multiple-choice benchmark on local files: mmlu, ceval, cmmlu or multiple_choice "
            "(--data_path is then its directory or one subject's file; docs/eval.md).",
        ),
        num_fewshot: int = typer.Option(0, "--num_fewshot", "--num-fewshot", min=0, help="With --task."),
        subject: Optional[List[str]] = typer.Option(None, "--subject", help="With --task: only these."),
    ) -> None:
        """Mean token loss and perplexity over a JSONL file (answers of instruction records, all
        tokens of {"text": ...} records) and the exact-match accuracy of greedy answers where records
        have a reference answer; or with --task a benchmark's accuracy (acc, acc_norm)."""
        if task is not None:
            args = (num_fewshot, subject, batch_size, max_seq_len, tokenizer_path, dtype)
            bench = _benchmark(model_path, task, data_path, *args)
            if as_json:
                typer.echo(json.dumps(bench))
            else:
                _print_benchmark(bench)
            return
        from bmtrain_cli.data.encode import encode_scored_file
        from bmtrain_cli.models.scoring import score

        if not data_path.is_file():
            raise UserError(f"--data_path {data_path} does not exist or is not a file")
        model, tok = load_model_and_tokenizer(model_path, tokenizer_path, dtype)
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
        if exact_match and not _is_static(model):
            result.update(_exact_match(model, tok, data_path, template, data_format, max_new_tokens))
        result["seconds"] = round(time.perf_counter() - t0, 3)
        if as_json:
            typer.echo(json.dumps(result))
        else:
            em = (
                f"  exact match {100 * result['exact_match']:.1f}% of {result['exact_match_records']}"
                if result.get("exact_match_records")
                else ""
            )
            typer.echo(
                f"loss {result['loss']:.4f}  ppl {result['ppl']:.3f}  "
                f"tokens {result['tokens']}  records {result['records']}{em}"
            )
