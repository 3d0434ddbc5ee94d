"""bmtrain run: launcher command lines, argument forwarding, failure attribution."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.commands.run_cmd import split_train_args
from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel import faults
from bmtrain_cli.parallel.launch import failure_summary, plan_launch, run_plan


def _cfg(**par) -> Config:
    return Config.model_validate({"parallel_config": par, "train_config": {"output_dir": "out/x"}})


def test_cpu_plan_uses_nproc_per_node_and_world_size():
    plan = plan_launch(_cfg(data_parallel=2, tensor_parallel=2), ["--config", "c.yaml"], script="t.py")
    cmd = plan.command
    assert cmd[1:3] == ["-m", "paddle.distributed.launch"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert "--devices" not in cmd
    assert cmd[-3:] == ["t.py", "--config", "c.yaml"]
    assert cmd[cmd.index("--log_dir") + 1] == os.path.join("out/x", "launch")
    assert plan.env[faults.RUN_ID_ENV] in plan.status_dir


def test_gpu_plan_uses_devices():
    plan = plan_launch(_cfg(tensor_parallel=2), [], has_gpu=True, script="t.py")
    assert plan.command[plan.command.index("--devices") + 1] == "0,1"
    assert "--nproc_per_node" not in plan.command


def test_multi_node_plan_splits_world_over_nodes():
    plan = plan_launch(
        _cfg(data_parallel=4, tensor_parallel=2), [], nnodes=2, master="10.0.0.1:8090", script="t.py"
    )
    cmd = plan.command
    assert cmd[cmd.index("--nproc_per_node") + 1] == "4"
    assert cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[cmd.index("--master") + 1] == "10.0.0.1:8090"


def test_wrong_process_count_is_a_user_error():
    with pytest.raises(UserError, match="needs 4"):
        plan_launch(_cfg(data_parallel=4), [], nproc_per_node=3, script="t.py")
    with pytest.raises(UserError, match="not divisible by 3 nodes"):
        plan_launch(_cfg(data_parallel=4), [], nnodes=3, script="t.py")


def test_split_train_args_turns_known_flags_into_overrides():
    args = [
        "--data_path",
        "d.jsonl",
        "--output_dir=o",
        "--set",
        "parallel_config.data_parallel=2",
        "--foo",
        "1",
    ]
    overrides, passed = split_train_args(args)
    assert "train_config.data_path=d.jsonl" in overrides
    assert "train_config.output_dir=o" in overrides
    assert "parallel_config.data_parallel=2" in overrides
    assert passed == args  # everything is passed on unchanged


def test_split_train_args_refuses_unknown_and_maps_config_fields():
    train_options = {
        "--config",
        "-c",
        "--data_path",
        "--output_dir",
        "--resume",
        "--overwrite",
        "--set",
        "-s",
    }
    overrides, passed = split_train_args(
        ["--data_path", "d.jsonl", "--eval_data_path", "e.jsonl", "--resume"], train_options
    )
    assert "train_config.eval_data_path=e.jsonl" in overrides
    assert passed == ["--data_path", "d.jsonl", "--set", "train_config.eval_data_path=e.jsonl", "--resume"]
    with pytest.raises(UserError, match="unknown train option '--bogus'"):
        split_train_args(["--bogus", "1"], train_options)


def test_run_dry_run_prints_the_command(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "parallel_config:\n  data_parallel: 2\ntrain_config:\n  output_dir: " + str(tmp_path / "o") + "\n"
    )
    res = CliRunner().invoke(
        app,
        [
            "run",
            "--config",
            str(cfg),
            "--dry_run",
            "--set",
            "parallel_config.tensor_parallel=2",
            "--max_steps",
            "3",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "--nproc_per_node 4" in res.output
    # --max_steps is a config field, not a train option: it reaches the ranks as an override
    assert "--set train_config.max_steps=3" in res.output and "recipes/sft.py --config" in res.output


def test_failure_summary_blames_the_rank_that_raised(tmp_path):
    plan = plan_launch(_cfg(data_parallel=2), [], script="t.py", run_id="r1")
    plan.status_dir = str(tmp_path)
    dead_pid = 2**22 + 12345
    records = [
        {
            "rank": 0,
            "pid": os.getpid(),
            "host": faults.socket.gethostname(),
            "state": "failed",
            "time": 1.0,
            "error": "RuntimeError: [pair.cc:584] TIMEOUT self_rank = 0",
            "log": "l0",
        },
        {
            "rank": 1,
            "pid": dead_pid,
            "host": faults.socket.gethostname(),
            "state": "failed",
            "time": 2.0,
            "error": "ValueError: boom",
            "log": "l1",
        },
    ]
    for r in records:
        (tmp_path / f"rank-{r['rank']}.json").write_text(json.dumps(r))
    msg = failure_summary(plan)
    assert "rank 1 raised: ValueError: boom" in msg and "l1" in msg


def test_failure_summary_names_a_killed_rank(tmp_path):
    plan = plan_launch(_cfg(data_parallel=2), [], script="t.py", run_id="r1")
    plan.status_dir = str(tmp_path)
    host = faults.socket.gethostname()
    (tmp_path / "rank-0.json").write_text(
        json.dumps(
            {
                "rank": 0,
                "pid": os.getpid(),
                "host": host,
                "state": "failed",
                "time": 1.0,
                "error": "gloo TIMEOUT",
            }
        )
    )
    (tmp_path / "rank-1.json").write_text(
        json.dumps(
            {"rank": 1, "pid": 2**22 + 999, "host": host, "state": "running", "time": 1.0, "log": "w1"}
        )
    )
    msg = failure_summary(plan)
    assert "rank 1 died" in msg and "w1" in msg


def test_run_refuses_what_the_ranks_would_refuse_before_launching(tmp_path, monkeypatch):
    import bmtrain_cli.machine as env

    monkeypatch.setattr(env, "paddle_has_gpu", lambda: False)
    monkeypatch.setattr("bmtrain_cli.config.checks.paddle_has_gpu", lambda: False)
    launched = []
    monkeypatch.setattr("bmtrain_cli.parallel.launch.run_plan", lambda plan, **kw: launched.append(plan) or 0)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "parallel_config:\n  data_parallel: 2\ntrain_config:\n  data_path: x.jsonl\n  output_dir: "
        + str(tmp_path / "o")
        + "\n  precision: bf16\n"
    )
    res = CliRunner().invoke(app, ["run", "--config", str(cfg)])
    assert res.exit_code == 2 and "use precision: fp32" in res.output and not launched
    res = CliRunner().invoke(app, ["run", "--config", str(cfg), "--dry_run"])  # only prints the command
    assert res.exit_code == 0 and "--nproc_per_node 2" in res.output


def test_bmtrain_run_shows_each_line_as_the_launcher_writes_it(tmp_path, monkeypatch):
    """run_plan passes the launcher's output on line by line while it runs (a stand-in launcher, with the
    planned environment, waits for its first line to be shown before it goes on) and drops its
    traceback."""
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    release = tmp_path / "shown"
    launcher = f"""
import os, sys, time
print("step 1/2 loss 1.0")
deadline = time.time() + 20
while not os.path.exists({str(release)!r}) and time.time() < deadline:
    time.sleep(0.05)
print("step 2/2 loss 0.5" if os.path.exists({str(release)!r}) else "the first line was held back")
raise RuntimeError("gloo: Connection reset by peer")
"""

    class Console(io.StringIO):
        def write(self, text: str) -> int:
            if "step 1/2" in text:
                release.touch()
            return super().write(text)

    console = Console()
    monkeypatch.setattr(sys, "stdout", console)
    cfg = Config.model_validate({"train_config": {"output_dir": str(tmp_path / "out")}})
    plan = dataclasses.replace(plan_launch(cfg, [], script="t.py"), command=[sys.executable, "-c", launcher])
    t0 = time.time()
    assert run_plan(plan, echo=False) == 1
    assert time.time() - t0 < 15
    assert console.getvalue().splitlines() == ["step 1/2 loss 1.0", "step 2/2 loss 0.5"]
