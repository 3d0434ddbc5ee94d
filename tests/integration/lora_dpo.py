"""The DPO-with-LoRA run that the QLoRA and mixture-of-experts DPO tests share: a tiny model trained by
SFT on the demo task, then DPO (sigmoid, beta 0.5, 6 steps) on seeded preference pairs through
`bmtrain train`, and the checks every such run must pass: the policy starts equal to the reference, the
loss falls, the margin grows, only the adapters are saved."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List, Tuple

import pytest
from typer.testing import CliRunner, Result

from bmtrain_cli.cli import app
from bmtrain_cli.preference.demo import preference_records
from tests.tiny import model_yaml

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

# {model}: more model_config lines; {targets}: lora_target_modules
DPO = """
model_config:
  model_name_or_path: {base}
  max_seq_len: 32
{model}train_config:
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
  lora_target_modules: {targets}
"""


def train(cfg: Path, *sets: str) -> Result:
    """`bmtrain train --config cfg [--set ...]` in this process."""
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    return CliRunner().invoke(app, args, catch_exceptions=False)


def sft_base_and_pairs(root: Path, *sets: str) -> Tuple[Path, Path]:
    """(the SFT checkpoint, the folder of train.jsonl preference pairs) under ``root``."""
    (root / "sft.yaml").write_text(SFT.format(out=root / "sft"))
    res = train(root / "sft.yaml", *sets)
    assert res.exit_code == 0, res.output
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(16)]
    data = root / "pairs"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in preference_records(words, rng)) + "\n")
    return root / "sft" / "checkpoints" / "step-4", data


def run_dpo(root: Path, base: Path, data: Path, model: str, targets: str) -> Tuple[Result, Path, List[dict]]:
    """DPO from ``base`` into root/out: (the CLI result, the step-6 checkpoint, the per-step train rows),
    after checking that it learned: step 1 with the adapters at B = 0 is the reference (loss log 2, margin
    0), the loss falls and the margin grows, and the checkpoint holds no full model weights."""
    cfg = root / "dpo.yaml"
    cfg.write_text(DPO.format(base=base, data=data, out=root / "out", model=model, targets=targets))
    res = train(cfg)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "event" not in r]
    assert len(steps) == 6
    losses = [r["loss"] for r in steps]
    margins = [r["rewards/margins"] for r in steps]
    assert losses[0] == pytest.approx(0.6931, abs=1e-3) and margins[0] == pytest.approx(0.0, abs=1e-4)
    assert losses[-1] < losses[0] - 0.05 and margins[-1] > 0.05, steps
    ckpt = root / "out" / "checkpoints" / "step-6"
    assert not list(ckpt.glob("model*.safetensors"))
    return res, ckpt, steps
