"""`bmtrain train` with LoRA on an nf4-quantised fresh base (QLoRA, model_config.quantization): the loss
falls, only the adapters are saved (PEFT layout), recompute is on, and a resume from the step-2
checkpoint continues with the losses of the uninterrupted run, exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

from tests.tiny import model_yaml

pytestmark = pytest.mark.slow

CONFIG = (
    model_yaml(kernels="custom")
    + """  quantization:
    method: nf4
    block_size: 32
train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: {steps}
  save_steps: 2
  micro_batch_size: 8
  learning_rate: 1.0e-2
  warmup_steps: 0
  lr_scheduler: constant
  gradient_checkpointing: true
  batching: packed
  finetuning: lora
  lora_rank: 4
  lora_target_modules: all-linear
"""
)


def _train(tmp: Path, run: str, steps: int, *extra: str, config: str = CONFIG) -> subprocess.CompletedProcess:
    from bmtrain_cli.data.demo import write_demo_data

    train, _ = write_demo_data(str(tmp / "data"))
    cfg = tmp / f"{run}.yaml"
    cfg.write_text(config.format(out=tmp / run, steps=steps, data=train))
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def _losses(run: Path) -> Dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_qlora_trains_saves_adapters_and_resumes_exactly(tmp_path):
    r = _train(tmp_path, "straight", 8)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "quantised base: 14 linear layers in nf4 (our CPU kernels)" in r.stdout, r.stdout[-2000:]
    straight = _losses(tmp_path / "straight")
    assert straight[8] < straight[1] - 0.1, straight
    ckpt = tmp_path / "straight" / "checkpoints" / "step-8"
    names = {p.name for p in ckpt.iterdir()}
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert not list(ckpt.glob("model*.safetensors"))

    r = _train(tmp_path, "resumed", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _train(tmp_path, "resumed", 8, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from step-2" in r.stdout
    resumed = _losses(tmp_path / "resumed")
    assert [resumed[s] for s in range(3, 9)] == [straight[s] for s in range(3, 9)]


INT8_VOCAB = CONFIG.replace(
    "method: nf4\n    block_size: 32\n", "method: int8\n    skip_modules: [norm, gate]\n"
)


def test_qlora_with_the_embedding_and_head_in_int8_trains_and_saves_adapters(tmp_path):
    """int8 with embed_tokens and lm_head out of skip_modules: the embedding (and the tied head) hold int8
    codes, the loss falls, and the checkpoint holds only the adapters."""
    assert INT8_VOCAB != CONFIG
    r = _train(tmp_path, "vocab", 6, config=INT8_VOCAB)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "linear layers in int8 (our CPU kernels), the embedding in int8" in r.stdout, r.stdout[-2000:]
    losses = _losses(tmp_path / "vocab")
    assert losses[6] < losses[1] - 0.1, losses
    ckpt = tmp_path / "vocab" / "checkpoints" / "step-6"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in ckpt.iterdir()}
    assert not list(ckpt.glob("model*.safetensors"))


MOE = CONFIG.replace(
    model_yaml(kernels="custom"),
    model_yaml(
        kernels="custom", family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    ),
)


def test_qlora_on_qwen3_moe_quantises_the_experts_trains_and_saves_adapters(tmp_path):
    """A tiny qwen3_moe with an nf4 base and LoRA on every linear layer, the routed experts' included: the
    experts hold nf4 codes (run as grouped calls), the loss falls, only the adapters are saved."""
    assert MOE != CONFIG
    r = _train(tmp_path, "moe", 6, config=MOE)
    assert r.returncode == 0, r.stderr[-3000:]
    # 2 layers x (4 attention projections + 4 experts x 3): the router stays unquantised
    assert "quantised base: 32 linear layers in nf4 (our CPU kernels)" in r.stdout, r.stdout[-2000:]
    losses = _losses(tmp_path / "moe")
    assert losses[6] < losses[1] - 0.1, losses
    ckpt = tmp_path / "moe" / "checkpoints" / "step-6"
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in ckpt.iterdir()}
    assert not list(ckpt.glob("model*.safetensors"))
    from safetensors.numpy import load_file

    names = list(load_file(str(ckpt / "adapter_model.safetensors")))
    assert all("lora_" in n for n in names)
    from bmtrain_cli.lora.merge import load_adapter_arrays  # the stacked experts' adapters, per expert

    assert any(".mlp.experts.3.down_proj.lora_A" in n for n in load_adapter_arrays(ckpt)), names[:8]
