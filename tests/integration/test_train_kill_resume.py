"""kill -9 at random steps, resume, and the per-step losses equal an uninterrupted run (fp32, 1 process)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny import model_yaml

CONFIG = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: 14
  micro_batch_size: 8
  global_batch_size: 16
  learning_rate: 3.0e-3
  warmup_steps: 3
  logging_steps: 1
  save_steps: 2
  save_total_limit: 2
  num_workers: 1
"""
)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _cmd(cfg: Path, *extra: str):
    return [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg), *extra]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _losses(out: Path):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def _last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            continue
    return max(steps, default=0)


def test_sigkill_resume_matches_uninterrupted(tmp_path):
    ref_cfg = tmp_path / "ref.yaml"
    ref_cfg.write_text(CONFIG.format(out=tmp_path / "ref"))
    subprocess.run(_cmd(ref_cfg), check=True, env=_env(), timeout=600, capture_output=True)
    reference = _losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, 15))

    out = tmp_path / "killed"
    cfg = tmp_path / "killed.yaml"
    cfg.write_text(CONFIG.format(out=out))
    rng = random.Random(1234)
    kills = 0
    for target in sorted(rng.sample(range(2, 13), 3)):
        proc = subprocess.Popen(
            _cmd(cfg, "--resume"), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.time() + 300
        while proc.poll() is None and _last_step(out) < target and time.time() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 2
    done = subprocess.run(_cmd(cfg, "--resume"), env=_env(), timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(out) == reference
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 14
