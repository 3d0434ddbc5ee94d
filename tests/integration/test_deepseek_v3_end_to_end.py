"""DeepSeek-V3 (multi-head latent attention + sigmoid group-limited experts) as a user meets it: the parity
fixture written by transformers (tests/fixtures/hf/make_fixtures.py) goes through validate-config, train
with a checkpoint, resume, generate and the Hugging Face export, which transformers reads back with our
logits; LoRA on the latent-attention projections writes a PEFT adapter that PEFT loads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_families_end_to_end import (  # noqa: F401  (tokenizer: a fixture)
    CONFIG,
    FIXTURES,
    _bmtrain,
    _reference_python,
    tokenizer,
)

LORA = (
    "  finetuning: lora\n  lora_rank: 4\n  lora_alpha: 8\n"
    "  lora_target_modules: [q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj]\n"
)


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    shutil.copytree(
        FIXTURES / "deepseek_v3", model, ignore=shutil.ignore_patterns("reference.npz", "generator.json")
    )
    return model


def _in_transformers(script: str, *args: str) -> str:
    py = _reference_python()
    assert py is not None
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run([py, "-c", script, *args], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


@pytest.mark.slow
def test_deepseek_v3_trains_resumes_generates_and_exports_to_transformers(tokenizer, tmp_path):  # noqa: F811  (a fixture)
    cfg, out = tmp_path / "train.yaml", tmp_path / "out"
    cfg.write_text(CONFIG.format(model=_model(tmp_path), tokenizer=tokenizer, out=out, steps=4, lora=""))
    assert "deepseek_v3" in _bmtrain("validate-config", str(cfg)).stdout
    _bmtrain("train", "--config", str(cfg), "--set", "train_config.max_steps=2")
    _bmtrain("train", "--config", str(cfg), "--resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and np.isfinite(summary["final_loss"])
    ckpt = out / "checkpoints" / "step-4"
    gen = _bmtrain("generate", "--model_path", str(ckpt), "--prompt", "abc=", "--max_new_tokens", "4")
    assert "[4 tokens in" in gen.stderr
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "hf"), "-f", "hf")
    # the experts' dispatch does not trace to a static graph: refused with the way out, nothing written
    pi = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "export", "-c", str(ckpt), "-o", str(tmp_path / "pi")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pi.returncode != 0 and "export --format hf" in pi.stderr and not (tmp_path / "pi").exists()
    if _reference_python() is None:
        return
    ids = np.random.default_rng(0).integers(3, 40, [2, 20])
    np.save(tmp_path / "ids.npy", ids)
    _in_transformers(
        "import sys, numpy as np, torch, transformers\n"
        "d = sys.argv[1]\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(d + '/hf', dtype=torch.float32).eval()\n"
        "assert type(m).__name__ == 'DeepseekV3ForCausalLM', type(m)\n"
        "with torch.no_grad(): out = m(input_ids=torch.from_numpy(np.load(d + '/ids.npy'))).logits\n"
        "np.save(d + '/hf_logits.npy', out.numpy())\n",
        str(tmp_path),
    )
    import paddle

    from bmtrain_cli.models import load_pretrained

    ours = load_pretrained(ckpt)(paddle.to_tensor(ids)).numpy()
    assert np.abs(np.load(tmp_path / "hf_logits.npy") - ours).max() <= 1e-4


@pytest.mark.slow
def test_lora_on_the_latent_attention_projections_loads_in_peft(tokenizer, tmp_path):  # noqa: F811  (a fixture)
    model = _model(tmp_path)
    cfg, out = tmp_path / "train.yaml", tmp_path / "out"
    cfg.write_text(CONFIG.format(model=model, tokenizer=tokenizer, out=out, steps=2, lora=LORA))
    _bmtrain("train", "--config", str(cfg))
    ckpt = out / "checkpoints" / "step-2"
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "peft"), "-f", "hf", "--no-merge")
    _bmtrain("export", "-c", str(ckpt), "-o", str(tmp_path / "merged"), "-f", "hf")
    adapter = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
    }
    if _reference_python() is None:
        return
    ids = np.random.default_rng(1).integers(3, 40, [2, 12])
    np.save(tmp_path / "ids.npy", ids)
    got = _in_transformers(
        "import sys, numpy as np, torch, transformers, peft\n"
        "d, base = sys.argv[1], sys.argv[2]\n"
        "load = lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()\n"
        "m = peft.PeftModel.from_pretrained(load(base), d + '/peft').eval()\n"
        "ids = torch.from_numpy(np.load(d + '/ids.npy'))\n"
        "with torch.no_grad():\n"
        "    a, b, c = (x(input_ids=ids).logits for x in (m, load(d + '/merged'), load(base)))\n"
        "print(float((a - b).abs().max()), float((a - c).abs().max()))\n",
        str(tmp_path),
        str(model),
    )
    to_merged, to_base = (float(x) for x in got.strip().splitlines()[-1].split())
    assert to_merged <= 1e-4 and to_base > 1e-3  # PEFT's adapters are ours, and they changed the model
