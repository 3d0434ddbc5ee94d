"""Adding a model family is adding one module: in a scratch copy of the package, a toy family file under
models/families/ is picked up by the schema, validate-config, training and the Hugging Face export, with
nothing else changed (the walk-through in docs/architecture.md, "Adding a model family")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

TOY = '''"""Toy: a GeGLU decoder with q/k/v biases and q/k norm (written by the test)."""

from bmtrain_cli.models.families._base import Family

FAMILY = Family(
    name="toy",
    model_types=("toy_lm",),
    hf_architecture="ToyForCausalLM",
    description="a test family",
    defaults={"hidden_act": "gelu_pytorch_tanh", "attention_bias": True, "qk_norm": True},
    o_proj_bias=False,
)
'''

CONFIG = """
model_config:
  family: toy
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  max_seq_len: 24
  kernels: reference
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: 2
  micro_batch_size: 4
  learning_rate: 1.0e-3
  logging_steps: 1
  save_steps: 2
  num_workers: 0
"""


@pytest.mark.slow
def test_a_family_added_as_one_file_trains_and_exports(tmp_path):
    scratch = tmp_path / "scratch"
    shutil.copytree(
        REPO / "bmtrain_cli", scratch / "bmtrain_cli", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(REPO / "recipes", scratch / "recipes")
    (scratch / "bmtrain_cli" / "models" / "families" / "toy.py").write_text(TOY, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(scratch), "OMP_NUM_THREADS": "1"}
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(CONFIG.format(out=tmp_path / "out"), encoding="utf-8")

    def bmtrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "bmtrain_cli", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=scratch,
            timeout=600,
        )

    schema = json.loads(bmtrain("schema").stdout)
    assert "toy" in json.dumps(schema)
    res = bmtrain("train", "--config", str(cfg))
    assert res.returncode == 0, res.stdout + res.stderr
    losses = [
        json.loads(x)["loss"]
        for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in x
    ]
    assert len(losses) == 2
    res = bmtrain("export", "-c", str(tmp_path / "out"), "-o", str(tmp_path / "hf"), "--format", "hf")
    assert res.returncode == 0, res.stdout + res.stderr
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["model_type"] == "toy_lm" and written["architectures"] == ["ToyForCausalLM"]
    assert written["hidden_act"] == "gelu_pytorch_tanh" and "attention_bias" not in written  # the default
    # the untouched package does not know the family
    plain = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "validate-config", str(cfg)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )
    assert plain.returncode == 2 and "toy" in plain.stdout + plain.stderr
