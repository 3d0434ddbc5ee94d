"""`bmtrain train` with finetuning: lora end to end: adapters-only checkpoints, resume (which verifies the
base model), the clear error when the base is gone, and export with and without merging."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny import model_yaml

pytestmark = pytest.mark.slow

CONFIG = (
    model_yaml(kernels=None)
    + """
train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: {steps}
  save_steps: 2
  micro_batch_size: 8
  learning_rate: 3.0e-3
  gradient_checkpointing: true
  batching: packed
  finetuning: lora
  lora_rank: 4
  lora_target_modules: all-linear
"""
)


def _train(tmp: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    cfg = tmp / "lora.yaml"
    from bmtrain_cli.data.demo import write_demo_data

    train, _ = write_demo_data(str(tmp / "data"))  # data_path (not demo_data): no accuracy pass, faster
    cfg.write_text(CONFIG.format(out=tmp / "run", steps=steps, data=train))
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_lora_train_resume_and_missing_base(tmp_path):
    r = _train(tmp_path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and not list(ckpt.glob("model*.safetensors"))
    record = json.loads((ckpt / "lora_base.json").read_text())
    assert record["base_model_name_or_path"] == str((run / "base_model").resolve())
    assert "trainable parameters" in r.stdout

    r = _train(tmp_path, 4, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step-2" in r.stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 4 in steps

    moved = tmp_path / "elsewhere"
    shutil.move(str(run / "base_model"), str(moved))
    r = _train(tmp_path, 6, "--resume")
    assert r.returncode == 2
    assert "cannot be found" in r.stderr + r.stdout and "Traceback" not in r.stderr

    shutil.move(str(moved), str(run / "base_model"))
    out = tmp_path / "merged"
    r = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "export", "-c", str(run), "-o", str(out), "--format", "hf"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import paddle

    from bmtrain_cli.lora import load_lora_checkpoint
    from bmtrain_cli.models import load_pretrained

    ids = paddle.to_tensor(np.arange(12).reshape(1, 12) % 50)
    with paddle.no_grad():
        want = load_lora_checkpoint(run / "checkpoints" / "step-4", kernels="reference")(ids).numpy()
        got = load_pretrained(str(out), kernels="reference")(ids).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
