"""Helpers shared by the commands: user-error handling and the --set option."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

import typer

from bmtrain_cli.errors import ConfigError, UserError, user_write_error

F = TypeVar("F", bound=Callable[..., Any])

SET_HELP = "Override a config value: --set train_config.max_steps=10 (repeatable)."


def set_option() -> Any:
    return typer.Option(None, "--set", "-s", help=SET_HELP, metavar="KEY.PATH=VALUE")


def tokenizer_path_option() -> Any:
    """``--tokenizer_path`` of the commands that use a model directory (generate, eval, serve, chat)."""
    return typer.Option(
        None,
        "--tokenizer_path",
        "--tokenizer-path",
        help="Tokenizer (sentencepiece .model, tokenizer.json or a directory); default: the model's.",
    )


def config_tokenizer_option() -> Any:
    """``--tokenizer`` of the data commands, which otherwise take the config's."""
    return typer.Option(None, "--tokenizer", help="Tokenizer path (overrides config).")


def fail(message: str, code: int = 2) -> None:
    """Print a user-facing error and exit (no traceback)."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


def user_errors(fn: F) -> F:
    """Turn UserError into a clean message and exit code 2; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            refuse_undecodable(kwargs)
            return fn(*args, **kwargs)
        except ConfigError as exc:
            n = len([p for p in exc.problems if p.severity == "error"])
            typer.echo(f"config has {n} problem{'s' if n != 1 else ''}:", err=True)
            for p in exc.problems:
                typer.echo("  " + p.format(), err=True)
            raise typer.Exit(2) from None
        except UserError as exc:
            typer.echo(f"error: {exc}", err=True)
            _record_rank_failure(f"{type(exc).__name__}: {exc}")
            raise typer.Exit(getattr(exc, "exit_code", 2)) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130) from None
        except OSError as exc:  # a write nothing below caught: a full disk, a read-only or forbidden path
            error = user_write_error(exc)
            if error is None:
                raise
            line = str(error)
            typer.echo(f"error: {line}", err=True)
            _record_rank_failure(f"WriteError: {line}")
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def refuse_undecodable(params: Dict[str, Any]) -> None:
    """Command-line bytes that are not UTF-8 (a Latin-1 file name, a binary paste) reach Python as lone
    surrogates, which cannot be printed, written or tokenised: refuse them, naming the option."""
    values: Sequence[Any]
    for name, value in params.items():
        if isinstance(value, typer.Context):  # `bmtrain run` passes its extra arguments on
            where, values = "argument", list(value.args)
        else:
            where, values = f"--{name.rstrip('_')}", value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, (str, Path)) and not str(v).isascii():
                try:
                    str(v).encode("utf-8")
                except UnicodeEncodeError:
                    raise UserError(f"{where} {ascii(str(v))} is not valid UTF-8 text") from None


def _record_rank_failure(message: str) -> None:
    """Under a distributed launch, mark this rank's status record failed with the message, so that
    `bmtrain run` blames this rank (not a peer the launcher stopped afterwards)."""
    faults = sys.modules.get("bmtrain_cli.parallel.faults")  # loaded only when a watchdog may run
    if faults is not None:
        try:
            faults.mark_failed(message[:2000])
        except OSError:
            pass


def overrides(values: Optional[List[str]]) -> List[str]:
    return list(values or [])
