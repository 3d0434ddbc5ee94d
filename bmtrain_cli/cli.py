"""The `bmtrain` command line. Thin: parse arguments, call the package, print, exit.

Each command lives in ``bmtrain_cli/commands/<name>.py`` and registers itself with ``register(app)``.
Heavy imports (Paddle) happen inside the commands, so `bmtrain --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, List, Optional

import typer

from bmtrain_cli import __version__

app = typer.Typer(
    name="bmtrain",
    help="Fine-tune large language models on PaddlePaddle from one YAML config.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # plain click help: it wraps option names instead of cutting them at 80 columns (rich truncates them)
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Order here is the order in `bmtrain --help`.
COMMAND_MODULES = (
    "config_cmds",  # validate-config, schema
    "train_cmd",  # train
    "run_cmd",  # run
    "data_cmds",  # prepare-data, data-stats
    "model_cmds",  # generate, eval
    "export_cmd",  # export
    "plan_cmd",  # plan
    "serve_cmds",  # serve, chat
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bmtrain-cli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Fine-tune large language models on PaddlePaddle from one YAML config."""


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        module_name = f"bmtrain_cli.commands.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # command not part of this build
                continue
            raise
        module.register(app)


_register_commands()


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point."""
    import warnings

    # Paddle's C++-extension helper warns at `import paddle` that ccache is missing (bmtrain_cli/quiet.py)
    warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
    warnings.formatwarning = _one_line_notices(warnings.formatwarning)
    app(args=argv, prog_name="bmtrain")


def run_recipe_script(module: ModuleType, argv: Optional[List[str]] = None) -> None:
    """A recipe run as ``python RECIPE.py --config C ...`` (and on every rank of `bmtrain run`): `bmtrain
    train` with the file as train_config.recipe, so that this running module's recipe() is the one run."""
    from bmtrain_cli.train.run import register_recipe

    path = register_recipe(module)
    args = list(sys.argv[1:] if argv is None else argv)
    main(["train", *args, "--recipe", str(path)])  # last: this file wins over a --recipe passed along


def _one_line_notices(default: Any) -> Any:
    """Our NoticeWarnings (a kernel fallback) as one ``warning: ...`` line; every other warning as Python
    formats it."""
    from bmtrain_cli.errors import NoticeWarning

    def fmt(message: Any, category: type, filename: str, lineno: int, line: Optional[str] = None) -> str:
        if issubclass(category, NoticeWarning):
            return f"warning: {message}\n"
        return default(message, category, filename, lineno, line)

    return fmt
