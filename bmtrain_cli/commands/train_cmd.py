"""`bmtrain train`: fine-tune the model of a config on its data."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Iterator, List, Optional

import typer

from bmtrain_cli.commands.common import set_option, user_errors
from bmtrain_cli.errors import UserError


def train_overrides(
    set_: Optional[List[str]],
    data_path: Optional[str],
    output_dir: Optional[str],
    resume: bool,
    overwrite: bool,
    recipe: Optional[str] = None,
) -> List[str]:
    """The CLI options are sugar for --set overrides (applied after the user's --set values)."""
    out = list(set_ or [])
    if recipe is not None:
        out.append(f"train_config.recipe={recipe}")
    if data_path is not None:
        out.append(f"train_config.data_path={data_path}")
    if output_dir is not None:
        out.append(f"train_config.output_dir={output_dir}")
    if resume:
        out.append("train_config.resume=true")
    if overwrite:
        out.append("train_config.overwrite_output_dir=true")
    return out


def default_threads() -> None:
    """Paddle sets OMP_NUM_THREADS=1 when it is unset; use the cores we have (up to 8) instead. Runs
    before Paddle is imported, and only when the user has not chosen."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, min(os.cpu_count() or 1, 8)))


def stop_on_signals() -> None:
    """Right after Paddle is imported (it installs C++ handlers that print a fatal-signal dump and end the
    process without flushing what was printed): SIGINT/SIGTERM end setup as a clean exit 130/143 through
    the usual paths (the output_dir lock released, printed lines flushed). The training loop replaces
    these with its own (save, then stop: train/loop/stopping.py) and puts them back after; train_main puts
    back the caller's when it returns (restored_signals)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def stop(signum: int, frame: object) -> None:
        from bmtrain_cli.train.loop.stopping import TrainingStopped

        name = signal.Signals(signum).name
        raise TrainingStopped(
            f"{name} received before training began: stopped, no checkpoint of this run was written or lost",
            exit_code=130 if signum == signal.SIGINT else 143,
        )

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


@contextlib.contextmanager
def restored_signals() -> Iterator[None]:
    """SIGINT/SIGTERM handlers as they were before, once the block ends (an in-process run, e.g. the
    Python API or a test, leaves the caller's Ctrl-C as it found it)."""
    import signal

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in old.items():
                signal.signal(sig, handler)


def train_main(
    config: str,
    set_: Optional[List[str]] = None,
    data_path: Optional[str] = None,
    output_dir: Optional[str] = None,
    resume: bool = False,
    overwrite: bool = False,
    recipe: Optional[str] = None,
) -> dict:
    with restored_signals():  # the handlers set below are this run's
        from bmtrain_cli.config import load_config
        from bmtrain_cli.parallel.context import launched_world_size

        stop_on_signals()  # before Paddle's import, which is the longest part of setup
        default_threads()
        from bmtrain_cli.quiet import import_paddle

        import_paddle()
        stop_on_signals()  # again: importing Paddle replaced them
        overrides = train_overrides(set_, data_path, output_dir, resume, overwrite, recipe)
        world = launched_world_size()
        loaded = load_config(config, overrides, mode="train", world_size=world if world > 1 else None)
        for w in loaded.warnings:
            typer.echo("  " + w.format(), err=True)
        resolved = Path(loaded.config.train.output_dir) / "config.yaml"
        if resolved.is_file() and os.path.samefile(resolved, loaded.source):
            raise UserError(
                f"the config file {config} is output_dir's config.yaml, which the run replaces with the resolved "
                "config; choose another --output_dir or copy the config elsewhere"
            )
        from bmtrain_cli.checkpoint_layout import own_output_dir
        from bmtrain_cli.train.run import run_training

        # one run owns output_dir (taken before anything there is read, replaced or deleted); under a
        # multi-node launch without a launcher-held lock, global rank 0 holds it for the job
        take = world <= 1 or os.environ.get("PADDLE_TRAINER_ID", "0") == "0"
        with own_output_dir(Path(loaded.config.train.output_dir), take=take):
            return run_training(loaded)


def register(app: typer.Typer) -> None:
    @app.command("train")
    @user_errors
    def train(
        config: Path = typer.Option(..., "--config", "-c", help="The config YAML file."),
        data_path: Optional[str] = typer.Option(
            None, "--data_path", "--data-path", help="Training JSONL (sets train_config.data_path)."
        ),
        output_dir: Optional[str] = typer.Option(
            None, "--output_dir", "--output-dir", help="Output directory (sets train_config.output_dir)."
        ),
        set_: Optional[List[str]] = set_option(),
        resume: bool = typer.Option(
            False, "--resume", help="Continue from the latest checkpoint in output_dir (if there is one)."
        ),
        overwrite: bool = typer.Option(
            False, "--overwrite", help="Start over in an output_dir that holds another run's checkpoints."
        ),
        recipe: Optional[str] = typer.Option(
            None,
            "--recipe",
            help="Train with this recipe file (a copy of recipes/sft.py you edited; sets train_config.recipe).",
        ),
    ) -> None:
        """Fine-tune the model of model_config on the data of train_config (through the recipe of
        train_config.stage, or the file of --recipe / train_config.recipe)."""
        train_main(str(config), set_, data_path, output_dir, resume, overwrite, recipe)
