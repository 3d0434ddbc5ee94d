"""A rank that raises, dies or hangs: every rank exits non-zero within a bounded time and the message
names the failing rank and its log (launched as `bmtrain run` does, through launch.plan_launch)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel.launch import plan_launch, run_plan

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "parallel_scripts" / "fault_worker.py"


def _run(tmp_path: Path, mode: str, capfd) -> tuple:
    out = tmp_path / "out"
    cfg = Config.model_validate(
        {"parallel_config": {"data_parallel": 2}, "train_config": {"output_dir": str(out)}}
    )
    plan = plan_launch(cfg, ["--mode", mode, "--output_dir", str(out), "--timeout", "5"], script=str(WORKER))
    t0 = time.time()
    rc = run_plan(plan, echo=False)
    elapsed = time.time() - t0
    console = capfd.readouterr()
    return rc, elapsed, console.out + console.err, plan


@pytest.mark.parametrize(
    "mode,what",
    [
        ("raise", "raised: ValueError: injected failure"),
        ("usererror", "raised: UserError: injected refusal"),  # exit 2 through user_errors, not "died"
        ("kill", "died"),
    ],
)
def test_failing_rank_is_named(tmp_path, capfd, mode, what):
    """The console shows the clear line, not the surviving rank's gloo traceback (issue 18: ~110 lines
    before it); the worker log keeps it."""
    rc, elapsed, err, plan = _run(tmp_path, mode, capfd)
    assert rc != 0
    assert elapsed < 60
    assert f"error: distributed run failed: rank 1 {what}" in err.splitlines()[-1], err
    assert str(Path(plan.log_dir).resolve() / "workerlog.1") in err
    assert "Traceback" not in err and "gloo" not in err and len(err.splitlines()) <= 4, err
    if mode == "kill":  # rank 0 stopped inside the all-reduce: its log has the traceback
        assert "Traceback" in (Path(plan.log_dir) / "workerlog.0").read_text()


def test_hanging_rank_times_out(tmp_path, capfd):
    rc, elapsed, err, plan = _run(tmp_path, "hang", capfd)
    assert rc != 0
    assert elapsed < 60  # fault_timeout_s is 5 s here
    assert "no progress for 5 s" in err and "rank 1" in err, err


def test_bmtrain_run_refuses_a_mismatched_process_count(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallel_config:\n  data_parallel: 2\n")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bmtrain_cli",
            "run",
            "--config",
            str(cfg),
            "--nproc_per_node",
            "3",
            "--dry_run",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "needs 2" in res.stderr
