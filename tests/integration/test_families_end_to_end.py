"""The 2026 dense families as a user meets them: a checkpoint directory written by transformers (the parity
fixtures, tests/fixtures/hf/make_fixtures.py) goes through validate-config, train with a checkpoint,
resume, generate, the Paddle Inference export and the Hugging Face export; transformers reads the export
back with our logits; LoRA on the family's own projection names writes a PEFT adapter PEFT loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "hf"
FAMILIES = ["ernie4_5", "gemma3_text", "glm4", "phi3_longrope", "gemma2", "qwen3_5_text"]

CONFIG = """
model_config:
  model_name_or_path: {model}
  tokenizer_path: {tokenizer}
  max_seq_len: 24
train_config:
  demo_data: reverse
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 4
  learning_rate: 1.0e-3
  logging_steps: 1
  save_steps: 2
  num_workers: 0
{lora}"""


def _bmtrain(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="2")
    res = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert res.returncode == 0, (args, res.stdout[-2000:], res.stderr[-3000:])
    return res


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """The quickstart's one-character sentencepiece tokenizer (ids fit the fixtures' 128 vocabulary)."""
    out = tmp_path_factory.mktemp("tok")
    cfg = out / "c.yaml"
    cfg.write_text(
        CONFIG.format(
            model=FIXTURES / "llama_gqa_llama3", tokenizer="null", out=out / "run", steps=1, lora=""
        )
        .replace("  model_name_or_path", "  family: llama\n  hidden_size: 64\n  num_hidden_layers: 1\n  #")
        .replace("  tokenizer_path: null\n", "")
    )
    _bmtrain("train", "--config", str(cfg))
    return out / "run" / "tokenizer"


def _reference_python():
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    return ref if ref and Path(ref).exists() else None


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_resumes_generates_and_exports(name, tokenizer, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / name, model, ignore=shutil.ignore_patterns("reference.npz", "generator.json"))
    cfg = tmp_path / "train.yaml"
    out = tmp_path / "out"
    cfg.write_text(CONFIG.format(model=model, tokenizer=tokenizer, out=out, steps=4, lora=""))
    check = _bmtrain("validate-config", str(cfg))
    assert name.split("_longrope")[0] in check.stdout

    _bmtrain("train", "--config", str(cfg), "--set", "train_config.max_steps=2")
    _bmtrain("train", "--config", str(cfg), "--resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])
    steps = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert steps[-1] == 4

    ckpt = out / "checkpoints" / "step-4"
    gen = _bmtrain("generate", "--model_path", str(ckpt), "--prompt", "abc=", "--max_new_tokens", "4")
    assert "[4 tokens in" in gen.stderr  # a random tiny model's tokens may decode to nothing printable

    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "pi"), "-f", "paddle-inference")
    served = _bmtrain(
        "generate", "--model_path", str(tmp_path / "pi"), "--prompt", "abc=", "--max_new_tokens", "4"
    )
    assert served.stdout == gen.stdout  # the exported static graph decodes the checkpoint's greedy tokens
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "hf"), "-f", "hf")
    py = _reference_python()
    if py is None:
        return
    from bmtrain_cli.models import load_pretrained

    ids = np.random.default_rng(0).integers(3, 40, [2, 20])
    np.save(tmp_path / "ids.npy", ids)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "d = sys.argv[1]\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(d + '/hf', dtype=torch.float32).eval()\n"
        "ids = torch.from_numpy(np.load(d + '/ids.npy'))\n"
        "with torch.no_grad(): out = m(input_ids=ids).logits.numpy()\n"
        "np.save(d + '/hf_logits.npy', out)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(
        [py, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    import paddle

    ours = load_pretrained(ckpt)(paddle.to_tensor(ids)).numpy()
    assert np.abs(np.load(tmp_path / "hf_logits.npy") - ours).max() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3_text", "phi3_longrope", "gemma2", "qwen3_5_text"])
def test_lora_on_the_family_names_loads_in_peft(name, tokenizer, tmp_path):
    """all-linear LoRA targets the family's own modules (Phi-3: qkv_proj, gate_up_proj); the PEFT export
    loads into transformers + PEFT and gives the merged model's logits."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / name, model, ignore=shutil.ignore_patterns("reference.npz", "generator.json"))
    cfg = tmp_path / "train.yaml"
    out = tmp_path / "out"
    lora = "  finetuning: lora\n  lora_rank: 4\n  lora_alpha: 8\n  lora_target_modules: all-linear\n"
    cfg.write_text(CONFIG.format(model=model, tokenizer=tokenizer, out=out, steps=2, lora=lora))
    _bmtrain("train", "--config", str(cfg))
    ckpt = out / "checkpoints" / "step-2"
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "peft"), "-f", "hf", "--no-merge")
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "merged"), "-f", "hf")
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    expected = {"qkv_proj", "gate_up_proj"} if name.startswith("phi3") else {"q_proj", "gate_proj"}
    if name == "qwen3_5_text":  # the linear-attention layers' projections too
        expected |= {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    assert expected <= set(adapter["target_modules"])
    py = _reference_python()
    if py is None:
        return
    ids = np.random.default_rng(1).integers(3, 40, [2, 12])
    np.save(tmp_path / "ids.npy", ids)
    script = (
        "import sys, numpy as np, torch, transformers, peft\n"
        "d, base = sys.argv[1], sys.argv[2]\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)\n"
        "m = peft.PeftModel.from_pretrained(m, d + '/peft').eval()\n"
        "merged = transformers.AutoModelForCausalLM.from_pretrained(d + '/merged', dtype=torch.float32).eval()\n"
        "ids = torch.from_numpy(np.load(d + '/ids.npy'))\n"
        "with torch.no_grad(): a, b = m(input_ids=ids).logits, merged(input_ids=ids).logits\n"
        "print(float((a - b).abs().max()))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(
        [py, "-c", script, str(tmp_path), str(model)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.strip().splitlines()[-1]) <= 1e-4
