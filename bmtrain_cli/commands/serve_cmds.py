"""`bmtrain serve` (an OpenAI-compatible HTTP server with a web chat page) and `bmtrain chat` (a terminal
chat): a checkpoint, a Hugging Face directory, an export, or a LoRA adapter over its base."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Optional, Tuple

import typer

from bmtrain_cli.commands.common import tokenizer_path_option, user_errors
from bmtrain_cli.commands.model_cmds import MODEL_HELP
from bmtrain_cli.errors import UserError

ADAPTER_HELP = "A LoRA adapter directory (adapter_config.json) to apply over --model_path, its base."
SERVE_EXTRA = "pip install 'bmtrain-cli[serve]'"


def _load_engine(
    model_path: Path, adapter: Optional[Path], tokenizer_path: Optional[Path], dtype: str, template: str
) -> Any:
    from bmtrain_cli.export.any_model import load_model_and_tokenizer
    from bmtrain_cli.serve.engine import Engine

    if adapter is None:
        model, tok = load_model_and_tokenizer(model_path, tokenizer_path, dtype)
        return Engine(model, tok, model_path.resolve().name, template)
    model, tok = _load_adapter(model_path, adapter, tokenizer_path, dtype)
    return Engine(model, tok, adapter.resolve().name, template)


def _load_adapter(
    model_path: Path, adapter: Path, tokenizer_path: Optional[Path], dtype: str
) -> Tuple[Any, Any]:
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.lora.adapter_store import is_lora_checkpoint, load_lora_checkpoint

    if not is_lora_checkpoint(adapter):
        raise UserError(f"--adapter {adapter} is not a LoRA adapter directory (no adapter_config.json)")
    if not (model_path / "config.json").is_file():
        raise UserError(
            f"--model_path {model_path}: the adapter's base must be a model directory with config.json"
        )
    tok_src = tokenizer_path or next(
        (
            d
            for d in (adapter, model_path)
            if any((d / f).is_file() for f in ("tokenizer.model", "tokenizer.json"))
        ),
        model_path,
    )
    tok = load_tokenizer(str(tok_src))
    model = load_lora_checkpoint(adapter, merge=True, dtype=dtype, alternatives=[str(model_path)])
    return model, tok


def _serve_libraries() -> Any:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UserError(f"bmtrain serve needs {exc.name}, part of the serve extra: {SERVE_EXTRA}") from None
    return uvicorn


def register(app: typer.Typer) -> None:
    @app.command("serve")
    @user_errors
    def serve_cmd(
        model_path: Path = typer.Option(..., "--model_path", "--model-path", help=MODEL_HELP),
        adapter: Optional[Path] = typer.Option(None, "--adapter", help=ADAPTER_HELP),
        host: str = typer.Option(
            "127.0.0.1", "--host", help="Address to bind (127.0.0.1: this machine only)."
        ),
        port: int = typer.Option(8000, "--port", min=0, max=65535),
        api_key: Optional[str] = typer.Option(None, "--api-key", "--api_key", help="Require 'Bearer KEY'."),
        max_tokens: int = typer.Option(512, "--max-tokens", "--max_tokens", min=1, help="Cap on max_tokens."),
        max_queue: int = typer.Option(
            64, "--max-queue", "--max_queue", min=1, help="Requests running or waiting at most."
        ),
        max_batch: int = typer.Option(
            32, "--max-batch", "--max_batch", min=1, help="Requests decoded together at most."
        ),
        template: str = typer.Option("auto", "--template", help="Chat template: auto or a built-in name."),
        tokenizer_path: Optional[Path] = tokenizer_path_option(),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    ) -> None:
        """Serve the model over an OpenAI-compatible HTTP API, with a web chat page at /."""
        uvicorn = _serve_libraries()
        from bmtrain_cli.serve.app import Server, build_app

        engine = _load_engine(model_path, adapter, tokenizer_path, dtype, template)
        engine.max_queue = max_queue
        engine.scheduler.max_batch = max_batch
        server = Server(engine, api_key=api_key, max_tokens=max_tokens)
        typer.echo(
            f"serving {engine.model_id} on http://{host}:{port} (chat page at /, API at /v1)", err=True
        )
        # uvicorn finishes the requests in flight on SIGTERM / Ctrl-C, then re-raises the signal to the
        # handler found at start: a no-op one, so that a requested shutdown exits 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        uvicorn.run(
            build_app(server), host=host, port=port, log_level="warning", timeout_graceful_shutdown=30
        )

    @app.command("chat")
    @user_errors
    def chat_cmd(
        model_path: Path = typer.Option(..., "--model_path", "--model-path", help=MODEL_HELP),
        adapter: Optional[Path] = typer.Option(None, "--adapter", help=ADAPTER_HELP),
        max_tokens: int = typer.Option(256, "--max_new_tokens", "--max-new-tokens", min=1),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy decoding."),
        top_p: float = typer.Option(1.0, "--top_p", "--top-p", min=0.0, max=1.0),
        seed: int = typer.Option(0, "--seed", min=0),
        system: Optional[str] = typer.Option(None, "--system", help="System prompt."),
        template: str = typer.Option("auto", "--template", help="Chat template: auto or a built-in name."),
        tokenizer_path: Optional[Path] = tokenizer_path_option(),
        dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 | float16"),
    ) -> None:
        """Chat with the model in the terminal (streamed replies, multi-turn)."""
        from bmtrain_cli.models.decoding import SamplingOptions
        from bmtrain_cli.serve.engine import Sampling
        from bmtrain_cli.serve.terminal import ChatSession, run_chat

        engine = _load_engine(model_path, adapter, tokenizer_path, dtype, template)

        def write(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()

        session = ChatSession(
            engine, Sampling(SamplingOptions(max_tokens, temperature, top_p, seed=seed)), write, _note
        )
        session.system = system
        interactive = sys.stdin.isatty()
        run_chat(session, lambda: input("> ") if interactive else _read_line())


def _note(text: str) -> None:
    typer.echo(text, err=True)


def _read_line() -> str:
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line
