"""Optimizer state across layouts: a tp2 run resumed under tp2 continues exactly (its per-rank optimizer
parts are reused), and resumed under tp1 says clearly that the moments restart."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny import model_yaml

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CONFIG = (
    model_yaml(kv_heads=None)
    + """
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: 4
  micro_batch_size: 4
  global_batch_size: 4
  learning_rate: 1.0e-2
  warmup_steps: 1
  logging_steps: 1
  save_steps: 2
  save_total_limit: 3
  shuffle: false
parallel_config:
  tensor_parallel: 2
"""
)


def _losses(out: Path):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _bmtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True, timeout=500
    )


def test_tp2_resume_reuses_per_rank_optimizer_state_and_tp1_restarts_moments(tmp_path):
    out = tmp_path / "tp2"
    cfg = tmp_path / "tp2.yaml"
    cfg.write_text(CONFIG.format(out=out))
    res = _bmtrain("run", "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    reference = _losses(out)
    assert sorted(reference) == [1, 2, 3, 4]
    step2 = out / "checkpoints" / "step-2"
    assert sorted(p.name for p in step2.glob("optimizer*")) == [
        "optimizer-rank-0.safetensors",
        "optimizer-rank-1.safetensors",
    ]
    layout = json.loads((step2 / "trainer_state.json").read_text())["optimizer_layout"]
    assert layout["tensor_parallel"] == 2 and layout["portable"] is False

    # the same layout from step 2: steps 3 and 4 repeat exactly (the moments were restored)
    shutil.rmtree(out / "checkpoints" / "step-4")
    (out / "checkpoints" / "latest").write_text("step-2\n")
    res = _bmtrain("run", "--config", str(cfg), "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not carried over" not in res.stdout + res.stderr
    resumed = _losses(out)
    np.testing.assert_allclose([resumed[3], resumed[4]], [reference[3], reference[4]], rtol=1e-5)

    # one process from the tp2 checkpoint: weights load, the optimizer state does not, and it says so
    res = _bmtrain(
        "train",
        "--config",
        str(cfg),
        "--set",
        "parallel_config.tensor_parallel=1",
        "--set",
        f"train_config.resume={step2}",
        "--output_dir",
        str(tmp_path / "tp1"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    text = res.stdout + res.stderr
    assert "optimizer state is not carried over; moments restart" in text and "tensor_parallel 2" in text
    assert sorted(_losses(tmp_path / "tp1")) == [3, 4]


@pytest.mark.parametrize("stage,offload", [(2, False), (3, True)], ids=["stage2", "stage3-offload"])
def test_group_sharded_stages_refuse_cpu_with_a_clear_message(tmp_path, stage, offload):
    """Sharding stage 2/3 go through ctx.wrapping.wrap_model_and_optimizer (group_sharded_parallel), which the CPU
    build of Paddle cannot run: `bmtrain run` refuses before launching, with exit code 2 (the ranks' config
    check and the parallel layer refuse the same way when launched directly)."""
    cfg = tmp_path / "sharded.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out").replace("tensor_parallel: 2", "sharding_parallel: 2"))
    sets = ["--set", f"parallel_config.sharding_stage={stage}", "--set", "train_config.global_batch_size=8"]
    if offload:
        sets += [
            "--set",
            "parallel_config.offload_params=true",
            "--set",
            "parallel_config.offload_optimizer=true",
        ]
    res = _bmtrain("run", "--config", str(cfg), *sets)
    text = res.stdout + res.stderr
    assert res.returncode == 2, text[-3000:]
    assert f"sharding_stage {stage}" in text and "needs a GPU build of Paddle" in text
    if offload:
        assert "with offload" in text
    assert "Traceback" not in text
