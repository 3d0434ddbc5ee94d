"""`bmtrain run`: launch the config's recipe (recipes/<stage>.py, or train_config.recipe / --recipe) on as
many processes as parallel_config asks for."""

from __future__ import annotations

from typing import List, Optional, Set, Tuple

import typer
import typer.core

from bmtrain_cli.commands.common import user_errors
from bmtrain_cli.errors import UserError

RUN_HELP = """Launch distributed training through `python -m paddle.distributed.launch`.

The process count is the product of the parallel_config degrees. Each rank runs the config's recipe
(recipes/<stage>.py, or the file of --recipe / train_config.recipe). Every argument not listed below is
passed on to it unchanged (e.g. --data_path, --output_dir, --recipe, --set key=value).

Multi-node: run the same command on every node with --nnodes and --master host:port.
"""


def split_train_args(
    args: List[str], train_options: Optional[Set[str]] = None
) -> Tuple[List[str], List[str]]:
    """(config overrides implied by the train arguments, the arguments to pass to every rank).

    ``--set k=v`` and ``--<config field> value`` / ``--<field>=value`` become overrides so that the world
    size and the output directory are computed from the same config the ranks will load. A config field
    that is not an option of `bmtrain train` is passed on as ``--set section.field=value``. With
    ``train_options`` (the options `bmtrain train` accepts), anything else is refused here, before any
    process starts."""
    from bmtrain_cli.config.schema import SECTION_MODELS

    fields = {name: section for section, model in SECTION_MODELS.items() for name in model.model_fields}
    overrides: List[str] = []
    passed: List[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--set", "-s") and i + 1 < len(args):
            overrides.append(args[i + 1])
            passed += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith("--set="):
            overrides.append(a.split("=", 1)[1])
            passed.append(a)
        elif a.startswith("-"):
            name, eq, value = a.partition("=")
            key = name.lstrip("-").replace("-", "_")
            is_option = train_options is None or name in train_options
            if key in fields:
                start = i
                if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value = args[i + 1]
                    i += 1
                    eq = "="
                if eq:
                    overrides.append(f"{fields[key]}.{key}={value}")
                if is_option:
                    passed += args[start : i + 1]
                elif eq:
                    passed += ["--set", f"{fields[key]}.{key}={value}"]
                else:
                    raise UserError(f"{name} needs a value (e.g. {name} VALUE)")
            elif is_option:
                passed.append(a)
            else:
                known = ", ".join(sorted(o for o in train_options or () if o.startswith("--")))
                raise UserError(
                    f"unknown train option {name!r} (train options: {known}; or --set key.path=value)"
                )
        else:
            passed.append(a)
        i += 1
    return overrides, passed


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        help=RUN_HELP,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @user_errors
    def run(
        ctx: typer.Context,
        config: str = typer.Option(..., "--config", "-c", help="YAML config file."),
        nproc_per_node: Optional[int] = typer.Option(
            None, "--nproc_per_node", help="Processes on this node (default: world size / nodes)."
        ),
        nnodes: Optional[int] = typer.Option(None, "--nnodes", help="Number of nodes (multi-node)."),
        ips: Optional[str] = typer.Option(None, "--ips", help="Comma-separated node IPs (launcher --ips)."),
        master: Optional[str] = typer.Option(None, "--master", help="host:port of the rendezvous master."),
        log_dir: Optional[str] = typer.Option(
            None, "--log_dir", help="Worker logs (default: <output_dir>/launch/workerlog.N)."
        ),
        dry_run: bool = typer.Option(False, "--dry_run", help="Print the launch command and exit."),
    ) -> None:
        from bmtrain_cli.config.load import load_config
        from bmtrain_cli.machine import paddle_has_gpu
        from bmtrain_cli.parallel.launch import plan_launch, run_plan

        extra = list(ctx.args)
        parent = ctx.parent
        train_cmd = (
            parent.command.get_command(parent, "train")
            if parent is not None and isinstance(parent.command, typer.core.TyperGroup)
            else None
        )
        train_options = (
            {opt for p in train_cmd.params for opt in p.opts + p.secondary_opts} if train_cmd else None
        )
        overrides, passed = split_train_args(extra, train_options)
        # the ranks start on this machine: refuse here what they would refuse (bf16 on a CPU-only Paddle, a
        # missing checkpoint or data path) instead of starting every process to fail the same way
        loaded = load_config(config, overrides, mode="validate" if dry_run else "train")
        plan = plan_launch(
            loaded.config,
            ["--config", config] + passed,
            nproc_per_node=nproc_per_node,
            nnodes=nnodes,
            ips=ips,
            master=master,
            log_dir=log_dir,
            has_gpu=paddle_has_gpu(),
        )
        if dry_run:
            typer.echo(" ".join(plan.command))
            return
        from pathlib import Path

        from bmtrain_cli.checkpoint_layout import own_output_dir

        # the job owns output_dir, not each rank: on one node the launcher holds it for every rank (they
        # see LOCK_ENV); across nodes, global rank 0 does (commands/train_cmd.py)
        with own_output_dir(Path(loaded.config.train.output_dir), take=plan.nnodes == 1):
            rc = run_plan(plan)
        if rc != 0:
            raise typer.Exit(rc)
