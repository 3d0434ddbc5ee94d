"""DPO with LoRA on a quantised base (QLoRA, model_config.quantization nf4 and int8): the preference
recipe runs on the quantised policy (the reference is the same base with the adapters off), the loss
moves, the reward margin grows, and only the adapters are saved."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.preference.demo import preference_records
from tests.tiny import model_yaml

pytestmark = pytest.mark.slow

SFT = (
    model_yaml(max_seq_len=24, kv_heads=None, vocab_size=512)
    + """
train_config:
  demo_data: reverse
  output_dir: {out}
  max_steps: 4
  micro_batch_size: 8
  learning_rate: 3.0e-3
  warmup_steps: 0
  save_steps: 4
  num_workers: 0
"""
)

DPO = """
model_config:
  model_name_or_path: {base}
  max_seq_len: 32
  kernels: reference
  quantization:
    method: {method}
train_config:
  stage: dpo
  dpo_loss: sigmoid
  dpo_beta: 0.5
  data_path: {data}/train.jsonl
  output_dir: {out}
  max_steps: 6
  micro_batch_size: 8
  learning_rate: 2.0e-2
  warmup_steps: 0
  lr_scheduler: constant
  logging_steps: 1
  save_steps: 6
  finetuning: lora
  lora_rank: 4
  lora_alpha: 8
  lora_target_modules: all-linear
"""


def _train(cfg: Path):
    return CliRunner().invoke(app, ["train", "--config", str(cfg)], catch_exceptions=False)


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora-dpo")
    (root / "sft.yaml").write_text(SFT.format(out=root / "sft"))
    res = _train(root / "sft.yaml")
    assert res.exit_code == 0, res.output
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(16)]
    data = root / "pairs"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in preference_records(words, rng)) + "\n")
    return root / "sft" / "checkpoints" / "step-4", data


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_dpo_trains_on_a_quantised_base(method, tmp_path, sft_base):
    base, data = sft_base
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(DPO.format(base=base, data=data, out=tmp_path / "out", method=method))
    res = _train(cfg)
    assert res.exit_code == 0, res.output
    assert f"linear layers in {method}" in res.output, res.output
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert len(train) == 6
    losses = [r["loss"] for r in train]
    margins = [r["rewards/margins"] for r in train]
    # step 1: adapters start at B = 0, so the policy equals the reference: loss log 2, margin 0
    assert losses[0] == pytest.approx(0.6931, abs=1e-3) and margins[0] == pytest.approx(0.0, abs=1e-4)
    assert losses[-1] < losses[0] - 0.05 and margins[-1] > 0.05, train
    ckpt = tmp_path / "out" / "checkpoints" / "step-6"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    assert not list(ckpt.glob("model*.safetensors"))
    record = json.loads((ckpt / "lora_base.json").read_text())
    assert record["quantization"]["method"] == method
