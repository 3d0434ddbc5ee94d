"""GGUF exports read by an independent reader: transformers' ``from_pretrained(dir, gguf_file=...)`` in
the reference venv ($BMTRAIN_REF_PYTHON) gives our model's logits and our tokenisation, for tiny trained
checkpoints of each family llama.cpp and transformers both read (LLaMA, Mistral, Phi-3, Gemma 2 and 3 with the
quickstart's sentencepiece model, Qwen2, Qwen3 and Qwen3-MoE with a byte-level BPE tokenizer.json), a
tied-embedding model and a LoRA run (merged on export)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny import model_yaml
from tests.unit.export.conftest import make_checkpoint
from tests.unit.export.gguf_models import TEXTS, family_checkpoint, logits_with_file_weights

pytestmark = pytest.mark.slow

REFERENCE = Path(__file__).with_name("gguf_reference.py")
IDS = np.random.default_rng(3).integers(3, 250, (2, 13)).astype(np.int64)
# max |logits difference| / max |logits| against our model: f16 as the issue asks; q8_0 measured on these
# models (<= 4.8e-2 on 2026-12-04, 2-core CPU: the 6-step Phi-3 and Qwen3-MoE are the most sensitive to the
# weights' rounding) with headroom. Against our model carrying the file's own rounded weights the layout
# alone is measured, and that agrees to fp32 round-off (FILE_WEIGHTS_TOLERANCE) for every type.
TOLERANCE = {"f16": 1e-3, "q8_0": 6e-2}
FILE_WEIGHTS_TOLERANCE = 1e-4
CASES = {
    "llama": dict(family="llama"),
    "mistral": dict(family="mistral"),
    "qwen2": dict(family="qwen2", tokenizer="bpe"),
    # transformers' GGUF reader takes Qwen3's head_dim from Qwen3Config's default (128), not from the file
    # (llama.cpp reads attention.key_length), so the tiny Qwen3 has Qwen3's head_dim
    "qwen3": dict(family="qwen3", tokenizer="bpe", head_dim=128),
    "llama_tied": dict(family="llama", tie=True),
    # Phi-3's fused qkv_proj/gate_up_proj as llama.cpp's attn_qkv/ffn_up (transformers reads neither the
    # rotary dimension nor LongRoPE from the file, so this one has full rotary and no scaling)
    "phi3": dict(family="phi3"),
    # transformers' reader takes query_pre_attn_scalar (256), the sliding layers' rope base and the layer
    # pattern from Gemma3TextConfig's defaults, llama.cpp from head_dim and its own constants: a tiny Gemma 3
    # they agree on has head_dim 256; six layers (the sixth global), a window of 4 that the 13-token rows
    # pass, tied embeddings as Gemma's
    "gemma3": dict(
        family="gemma3_text", head_dim=256, query_pre_attn_scalar=256, sliding_window=4, num_hidden_layers=6
    ),
    # transformers' reader takes moe_intermediate_size from Qwen3MoeConfig's default (768) and head_dim
    # from the file; llama.cpp reads expert_feed_forward_length
    "qwen3_moe": dict(family="qwen3_moe", tokenizer="bpe", head_dim=128, moe_intermediate_size=768),
    # the reader takes query_pre_attn_scalar (256) and both soft-caps (50, 30) from Gemma2Config's defaults
    # (ours too), llama.cpp the caps from the file: head_dim 256, a window of 4 the rows pass
    "gemma2": dict(
        family="gemma2", head_dim=256, query_pre_attn_scalar=256, sliding_window=4, num_hidden_layers=4
    ),
}
TIED = {"llama_tied", "gemma3", "gemma2"}
SLIDING_WINDOW = {"gemma3": 4, "gemma2": 4}
MAX_NEW_TOKENS = 6
EXPECTED_TYPE = {
    "demo": "llama",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "llama_tied": "llama",
    "phi3": "phi3",
    "gemma3": "gemma3_text",
    "qwen3_moe": "qwen3_moe",
    "gemma2": "gemma2",
    "lora": "llama",
}

LORA_CONFIG = (
    model_yaml(kernels="reference")
    + """
train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: 3
  save_steps: 3
  micro_batch_size: 8
  learning_rate: 1.0e-2
  batching: packed
  finetuning: lora
  lora_rank: 4
  lora_target_modules: all-linear
"""
)


def _reference_python():
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    return ref if ref and Path(ref).exists() else None


def _lora_run(root: Path) -> Path:
    from bmtrain_cli.data.demo import write_demo_data

    train, _ = write_demo_data(str(root / "data"))
    cfg = root / "lora.yaml"
    cfg.write_text(LORA_CONFIG.format(data=train, out=root / "run"))
    r = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "run"


def _demo_prompts(run: Path) -> list:
    """Token ids of the first held-out demo prompts, as the model saw them in training (BOS + prompt)."""
    from bmtrain_cli.data.tokenizers import load_tokenizer

    tok = load_tokenizer(str(run / "checkpoints" / "step-60"))
    records = [
        json.loads(line) for line in (run.parent / "data" / "heldout.jsonl").read_text().splitlines()[:8]
    ]
    return [[tok.bos_id] * tok.add_bos + tok.encode(r["input"]) for r in records]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    py = _reference_python()
    if py is None:
        pytest.skip("set BMTRAIN_REF_PYTHON to a Python with torch, transformers and gguf")
    from bmtrain_cli.export.loading import load_for_inference
    from bmtrain_cli.export.pipeline import export_checkpoint

    root = tmp_path_factory.mktemp("gguf_ref")
    runs = {name: family_checkpoint(root / name, **kw) for name, kw in CASES.items()}
    runs["lora"] = _lora_run(root / "lora")
    runs["demo"] = make_checkpoint(
        root / "demo"
    )  # the export tests' checkpoint (60 steps), for greedy decoding
    out = {}
    for name, run in runs.items():
        logits = load_for_inference(str(run), kernels="reference").logits(IDS)
        for q in TOLERANCE:
            d = root / "exports" / f"{name}-{q}"
            export_checkpoint(str(run), str(d), fmt="gguf", quantize=q, log=lambda m: None)
            np.save(d / "ids.npy", IDS)
            (d / "texts.json").write_text(json.dumps(TEXTS, ensure_ascii=False), encoding="utf-8")
            if name == "demo":
                spec = {"prompts": _demo_prompts(run), "max_new_tokens": MAX_NEW_TOKENS}
                (d / "prompts.json").write_text(json.dumps(spec), encoding="utf-8")
            out[(name, q)] = (d, logits, logits_with_file_weights(run, q, IDS))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH="")
    r = subprocess.run(
        [py, str(REFERENCE), *[str(v[0]) for v in out.values()]],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("quantize", list(TOLERANCE))
@pytest.mark.parametrize("name", [*CASES, "lora", "demo"])
def test_transformers_reads_our_gguf(exports, name, quantize):
    from bmtrain_cli.data.tokenizers import load_tokenizer

    d, ours, ours_rounded = exports[(name, quantize)]
    ref = json.loads((d / "ref.json").read_text(encoding="utf-8"))
    assert "error" not in ref, ref.get("error")
    theirs = np.load(d / "ref_logits.npy")
    assert ref["model_type"] == EXPECTED_TYPE[name]
    assert ref["tie_word_embeddings"] is (name in TIED)
    if name in SLIDING_WINDOW:
        assert ref["sliding_window"] == SLIDING_WINDOW[name]
    layout = np.abs(theirs - ours_rounded).max() / np.abs(ours_rounded).max()
    print(f"{name} {quantize}: against our model with the file's rounded weights {layout:.2e}")
    assert layout <= FILE_WEIGHTS_TOLERANCE
    rel = np.abs(theirs - ours).max() / np.abs(ours).max()
    print(f"{name} {quantize}: max |dlogits| / max |logits| = {rel:.2e}")
    assert rel <= TOLERANCE[quantize]
    tok = load_tokenizer(str(d))
    assert ref["ids"] == [tok.encode(t) for t in TEXTS]
    assert ref["eos_token"] == tok.eos_token
    assert ref["chat_template"] == tok.chat_template


def test_greedy_generation_matches(exports):
    """transformers' greedy continuation of held-out demo prompts from the f16 GGUF is ours token for
    token; from q8_0 it is reported (and must agree on most prompts)."""
    from bmtrain_cli.export.loading import generate_static, load_for_inference
    from bmtrain_cli.models.decoding import SamplingOptions

    d = exports[("demo", "f16")][0]
    spec = json.loads((d / "prompts.json").read_text())
    model = load_for_inference(str(d.parent.parent / "demo" / "run"), kernels="reference")
    eos = model.tokenizer.eos_id
    ours = generate_static(
        model, spec["prompts"], SamplingOptions(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    )
    assert json.loads((d / "ref.json").read_text())["greedy"] == ours
    q8 = json.loads((exports[("demo", "q8_0")][0] / "ref.json").read_text())["greedy"]
    same = sum(a == b for a, b in zip(q8, ours))
    print(
        f"q8_0 greedy: {same}/{len(ours)} prompts identical to ours; answers {[model.tokenizer.decode(o) for o in ours]}"
    )
    assert same >= len(ours) - 2
