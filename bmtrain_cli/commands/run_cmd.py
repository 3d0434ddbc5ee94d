"""`bmtrain run`: launch recipes/train.py on as many processes as parallel_config asks for."""

from __future__ import annotations

from typing import List, Optional, Tuple

import typer

from bmtrain_cli.commands.common import user_errors

RUN_HELP = """Launch distributed training through `python -m paddle.distributed.launch`.

The process count is the product of the parallel_config degrees. Every argument not listed below is
passed on to recipes/train.py unchanged (e.g. --data_path, --output_dir, --set key=value).

Multi-node: run the same command on every node with --nnodes and --master host:port.
"""


def split_train_args(args: List[str]) -> Tuple[List[str], List[str]]:
    """(config overrides implied by the train arguments, the arguments themselves).

    ``--set k=v`` and ``--<train_config field> value`` / ``--<field>=value`` become overrides so that the
    world size and the output directory are computed from the same config the ranks will load."""
    from bmtrain_cli.config.schema import SECTION_MODELS

    fields = {name: section for section, model in SECTION_MODELS.items() for name in model.model_fields}
    overrides: List[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--set", "-s") and i + 1 < len(args):
            overrides.append(args[i + 1])
            i += 2
            continue
        if a.startswith("--set="):
            overrides.append(a.split("=", 1)[1])
        elif a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            key = key.replace("-", "_")
            if key in fields:
                if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                    value = args[i + 1]
                    i += 1
                if eq or value:
                    overrides.append(f"{fields[key]}.{key}={value}")
        i += 1
    return overrides, args


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
        from bmtrain_cli.config.env import paddle_has_gpu
        from bmtrain_cli.config.load import load_config
        from bmtrain_cli.parallel.launch import plan_launch, run_plan

        extra = list(ctx.args)
        overrides, passed = split_train_args(extra)
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
        rc = run_plan(plan)
        if rc != 0:
            raise typer.Exit(rc)
