"""Build and run the `python -m paddle.distributed.launch` command line for a config.

The world size comes from parallel_config (data x tensor x pipeline x sharding). On a CPU build the
launcher gets ``--nproc_per_node N`` (gloo); on a GPU build ``--devices 0,..,N-1`` (NCCL). Multi-node runs
use the launcher's own options (``--nnodes``, ``--master``, ``--ips``), with the same command on every
node. After the launcher returns, the rank status files (faults.py) name the rank that failed first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel import faults
from bmtrain_cli.quiet import LauncherConsole


@dataclass
class LaunchPlan:
    command: List[str]
    env: Dict[str, str]
    log_dir: str
    status_dir: str
    world_size: int
    nproc_per_node: int
    nnodes: int
    extra: Dict[str, str] = field(default_factory=dict)


def train_script(config: Config) -> Path:
    """The recipe every rank runs (the launchable entry point): train_config.recipe, else the stage's
    built-in one (recipes/<stage>.py, or the installed package's copy; bmtrain_cli/methods.py)."""
    from bmtrain_cli.methods import recipe_file

    path = recipe_file(config.train)
    if not path.is_file():
        fix = "check train_config.recipe" if config.train.recipe else "reinstall bmtrain-cli"
        raise UserError(f"cannot find the training recipe {path}: {fix}")
    return path


def plan_launch(
    config: Config,
    train_args: List[str],
    *,
    nproc_per_node: Optional[int] = None,
    nnodes: Optional[int] = None,
    ips: Optional[str] = None,
    master: Optional[str] = None,
    log_dir: Optional[str] = None,
    has_gpu: bool = False,
    script: Optional[str] = None,
    python: Optional[str] = None,
    run_id: Optional[str] = None,
) -> LaunchPlan:
    """The launcher command and environment for ``config`` (no process is started)."""
    world = config.parallel.world_size
    node_count = nnodes or (len(ips.split(",")) if ips else 1)
    if node_count < 1:
        raise UserError("--nnodes must be at least 1")
    if nproc_per_node is None:
        if world % node_count:
            raise UserError(
                f"the world size {world} (from parallel_config) is not divisible by {node_count} nodes; "
                "give --nproc_per_node or change the degrees"
            )
        nproc_per_node = world // node_count
    if nproc_per_node * node_count != world:
        raise UserError(
            f"--nproc_per_node {nproc_per_node} x {node_count} node(s) = {nproc_per_node * node_count} "
            f"processes, but parallel_config needs {world} (data {config.parallel.data_parallel} x tensor "
            f"{config.parallel.tensor_parallel} x pipeline {config.parallel.pipeline_parallel} x sharding "
            f"{config.parallel.sharding_parallel})"
        )
    out_dir = config.train.output_dir
    log_dir = log_dir or str(Path(out_dir) / "launch")
    rid = run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    # the launcher's own INFO lines (its whole configuration, every start) go to the log files only
    cmd = [python or sys.executable, "-m", "paddle.distributed.launch", "--log_dir", log_dir]
    cmd += ["--log_level", "WARNING"]
    if has_gpu:
        cmd += ["--devices", ",".join(str(i) for i in range(nproc_per_node))]
    else:
        cmd += ["--nproc_per_node", str(nproc_per_node)]
    if node_count > 1 or master or ips:
        if master:
            cmd += ["--master", master]
        if ips:
            cmd += ["--ips", ips]
        cmd += ["--nnodes", str(node_count)]
    cmd += [str(script or train_script(config))] + list(train_args)
    env = {
        faults.RUN_ID_ENV: rid,
        faults.LOG_DIR_ENV: str(Path(log_dir).resolve()),
        # Paddle's "No ccache found" warning at every `import paddle` (bmtrain_cli/quiet.py)
        "PYTHONWARNINGS": "ignore:No ccache found:UserWarning",
        # the launcher copies rank 0's log to its standard output, a pipe to run_plan: unbuffered, so
        # that every line shows when it is written (the ranks themselves run with -u)
        "PYTHONUNBUFFERED": "1",
    }
    return LaunchPlan(
        command=cmd,
        env=env,
        log_dir=log_dir,
        status_dir=str(faults.status_dir(out_dir, rid)),
        world_size=world,
        nproc_per_node=nproc_per_node,
        nnodes=node_count,
    )


def run_plan(plan: LaunchPlan, *, echo: bool = True) -> int:
    """Run the launcher, showing its output line by line as it comes without the error dumps of the
    ranks (quiet.LauncherConsole; the worker logs keep them); on failure print which rank failed first
    and where its log is. Returns the launcher's exit code."""
    env = dict(os.environ)
    env.update(plan.env)
    Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
    if echo:
        print(
            f"launching {plan.world_size} process(es): {' '.join(plan.command)}", file=sys.stderr, flush=True
        )
    console = LauncherConsole()
    # one pipe for the launcher's standard output (its copy of rank 0's log) and error (its own log
    # lines), so that they stay in the order the launcher wrote them
    with subprocess.Popen(plan.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            _show(console.feed(line))
        _show(console.close())
        returncode = proc.wait()
    if returncode != 0:
        print(failure_summary(plan), file=sys.stderr, flush=True)
    return returncode


def _show(lines: List[bytes]) -> None:
    for line in lines:
        sys.stdout.write(line.decode("utf-8", errors="replace"))
    if lines:
        sys.stdout.flush()


def failure_summary(plan: LaunchPlan) -> str:
    records = faults.read_records(Path(plan.status_dir))
    culprit = faults.first_failure(records)
    if culprit is not None:
        return f"error: distributed run failed: {faults.describe_failure(culprit)}"
    missing = sorted(set(range(plan.world_size)) - {int(r.get("rank", -1)) for r in records})
    if missing:
        return (
            f"error: distributed run failed before rank(s) {', '.join(map(str, missing))} started; see "
            + ", ".join(
                str(Path(plan.log_dir) / f"workerlog.{r}") for r in missing if r < plan.nproc_per_node
            )
        )
    return f"error: distributed run failed; see the worker logs in {plan.log_dir}"
