"""`bmtrain plan` as a user types it: --gpu_memory needs its unit, the --search list is in the order its
header states, and a GPU plan is not judged against this machine's CPU build of Paddle."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.plan.search import _complexity  # the ranking's tie-breaker, as the header describes it

runner = CliRunner()
SEVEN_B = "configs/llama2-7b-sft-8gpu.yaml"


def test_gpu_memory_without_a_unit_is_refused(repo_root):
    r = runner.invoke(
        app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "8", "--gpu_memory", "80"]
    )
    assert r.exit_code == 2 and "'80' has no unit: write 80GiB" in r.output
    r = runner.invoke(
        app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "8", "--gpu_memory", "80GiB"]
    )
    assert r.exit_code == 0 and "of 80.00 GiB: fits" in r.output


def test_search_order_matches_its_header_and_no_cpu_warnings(repo_root):
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.devices import get_device
    from bmtrain_cli.plan.estimator import Workload
    from bmtrain_cli.plan.search import search

    argv = ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "8", "--gpu_memory", "80GiB", "--search"]
    r = runner.invoke(app, [*argv, "--top", "30"])
    assert r.exit_code == 0, r.output
    assert "each extra setting" in r.output and "counted as 1% slower" in r.output
    assert "fastest first" not in r.output
    assert "this machine would refuse" not in r.output  # a GPU plan: no CPU-build warnings
    listed = [float(t) for t in re.findall(r"^\s+\d+\.\s+([0-9.]+) s", r.output, flags=re.M)]
    found = search(
        Workload.from_config(load_config(str(repo_root / SEVEN_B)).config), get_device("A100-80GB"), 8, top=30
    )
    assert listed == [round(c.step_time_s, 2) for c in found["ranked"]]
    # the order the header states: step time with 1% per extra setting (0.5% ties)
    effective = [c.step_time_s * (1 + 0.01 * _complexity(c.layout)) for c in found["ranked"]]
    assert all(a <= b * 1.006 for a, b in zip(effective, effective[1:])), effective
