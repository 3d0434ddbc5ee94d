"""`bmtrain train` on the CPU folds the global-norm clip into CpuAdamW's fused update (train/optimizer/adamw.clip_for_step):
per-step losses and norms equal a run that scales the gradients first (clip_grads_), with the clip firing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.train.optimizer import adamw as optim
from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW
from tests.tiny import model_yaml

CONFIG = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: 6
  micro_batch_size: 8
  global_batch_size: 16
  learning_rate: 3.0e-3
  warmup_steps: 3
  weight_decay: 0.1
  max_grad_norm: 0.2
  logging_steps: 1
  save_steps: 100
  eval_steps: 100
  num_workers: 0
"""
)

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, name: str) -> dict:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / name), encoding="utf-8")
    res = CliRunner().invoke(app, ["train", "--config", str(cfg)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs if "loss" in r}


def test_folded_clip_gives_the_losses_of_clipping_the_gradients(tmp_path, monkeypatch):
    scales = []
    set_grad_scale = CpuAdamW.set_grad_scale

    def spy(self, factor):
        scales.append(factor)
        set_grad_scale(self, factor)

    monkeypatch.setattr(CpuAdamW, "set_grad_scale", spy)
    folded = _run(tmp_path, "folded")
    assert len(scales) == 6 and all(f < 0.2 for f in scales)  # the clip fired and was folded every step
    monkeypatch.setattr(optim, "clip_for_step", lambda _opt, params, m, n: optim.clip_grads_(params, m, n))
    clipped = _run(tmp_path, "clipped")
    assert len(scales) == 6  # the second run scaled the gradients instead
    assert sorted(folded) == list(range(1, 7))
    for step, (loss, norm) in clipped.items():
        assert folded[step][0] == pytest.approx(loss, abs=1e-6), step
        assert folded[step][1] == pytest.approx(norm, rel=1e-6), step
