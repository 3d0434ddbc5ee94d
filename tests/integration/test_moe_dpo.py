"""DPO on a mixture-of-experts policy through `bmtrain train`: a tiny qwen3_moe trained by SFT, then DPO
with LoRA on the attention and on every expert's gate/up/down (the grouped GEMM on a CPU with our
kernels). The policy starts equal to the reference (loss log 2), the loss falls, the margin grows, and
only the adapters are saved, the experts' among them."""

from __future__ import annotations

import json
import random

import pytest
from safetensors.numpy import load_file
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
  lora_target_modules: [q_proj, v_proj, gate_proj, up_proj, down_proj]
"""


def _train(cfg, *sets):
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_dpo_with_lora_on_the_experts_of_a_qwen3_moe(tmp_path):
    (tmp_path / "sft.yaml").write_text(SFT.format(out=tmp_path / "sft"))
    res = _train(tmp_path / "sft.yaml", "model_config.family=qwen3_moe", "model_config.num_experts=4")
    assert res.exit_code == 0, res.output
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(16)]
    data = tmp_path / "pairs"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in preference_records(words, rng)) + "\n")
    base = tmp_path / "sft" / "checkpoints" / "step-4"
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(DPO.format(base=base, data=data, out=tmp_path / "out"))
    res = _train(cfg)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert len(train) == 6
    losses = [r["loss"] for r in train]
    margins = [r["rewards/margins"] for r in train]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3) and margins[0] == pytest.approx(0.0, abs=1e-4)
    assert losses[-1] < losses[0] - 0.05 and margins[-1] > 0.05, train
    ckpt = tmp_path / "out" / "checkpoints" / "step-6"
    assert not list(ckpt.glob("model*.safetensors"))
    names = list(load_file(str(ckpt / "adapter_model.safetensors")))
    experts = [n for n in names if ".mlp.experts." in n]
    # the tiny model's 2 layers x 4 experts x gate/up/down x A/B
    assert len(experts) == 2 * 4 * 3 * 2, names
