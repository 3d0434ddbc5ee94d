"""Preference tuning through `bmtrain run` equals one process, step by step (loss and TRL's metrics at
1e-5): data parallel with LoRA (reference = adapters off), precomputed reference log-probs and packed
pairs; tensor parallel with full fine-tuning (reference = a frozen tensor-parallel copy) and recompute;
sharding stage 1 with ORPO (reference-free, token-weighted NLL); pipeline parallel, alone and beside
context parallel."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.preference.demo import preference_records
from tests.tiny import model_yaml

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SFT = (
    model_yaml(vocab_size=512)
    + """
train_config:
  demo_data: reverse
  output_dir: {out}
  max_steps: 2
  micro_batch_size: 8
  learning_rate: 1.0e-2
  save_steps: 2
"""
)

DPO = """
model_config:
  model_name_or_path: {base}
  max_seq_len: {seq}
  kernels: reference
train_config:
  stage: dpo
  dpo_loss: {loss}
  dpo_beta: 0.5
  data_path: {data}/train.jsonl
  eval_data_path: {data}/eval.jsonl
  output_dir: {out}
  overwrite_output_dir: true
  max_steps: 3
  micro_batch_size: 4
  global_batch_size: 8
  learning_rate: 5.0e-3
  logging_steps: 1
  eval_steps: 3
  save_steps: 3
  shuffle: false
{extra}
parallel_config:
  data_parallel: {dp}
  tensor_parallel: {tp}
  sharding_parallel: {sharding}
  pipeline_parallel: {pp}
  context_parallel: {cp}
"""

KEYS = ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")


def _bmtrain(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True, timeout=400
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple:
    """An SFT checkpoint of the tiny model on the reverse task, and pair files of that task."""
    root = tmp_path_factory.mktemp("pref")
    cfg = root / "sft.yaml"
    cfg.write_text(SFT.format(out=root / "sft"))
    _bmtrain("train", "--config", str(cfg))
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(40)]
    data = root / "data"
    data.mkdir()
    for name, part in (("train", words[:32]), ("eval", words[32:])):
        lines = [json.dumps(r) for r in preference_records(part, rng)]
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root / "sft" / "checkpoints" / "step-2", data


def _run(
    tmp: Path,
    base: tuple,
    name: str,
    dp: int,
    tp: int,
    loss: str,
    extra: str,
    sharding: int = 1,
    pp: int = 1,
    cp: int = 1,
    seq: int = 32,
) -> dict:
    cfg = tmp / f"{name}.yaml"
    out = tmp / name
    cfg.write_text(
        DPO.format(
            base=base[0],
            data=base[1],
            out=out,
            dp=dp,
            tp=tp,
            loss=loss,
            extra=extra,
            sharding=sharding,
            pp=pp,
            cp=cp,
            seq=seq,
        )
    )
    _bmtrain("train" if dp * tp * sharding * pp * cp == 1 else "run", "--config", str(cfg))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return {"train": train, "eval": evals, "summary": json.loads((out / "summary.json").read_text())}


def _same(a: dict, b: dict) -> None:
    assert len(a["train"]) == len(b["train"]) == 3 and len(a["eval"]) == len(b["eval"]) == 1
    for key in KEYS:  # atol: a reward that is 0 in one process is +-1e-7 when the pairs are packed otherwise
        got, want = [r[key] for r in b["train"]], [r[key] for r in a["train"]]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0 if key == "loss" else 1e-6, err_msg=key)
    np.testing.assert_allclose(b["eval"][0]["eval_loss"], a["eval"][0]["eval_loss"], rtol=1e-5)
    assert a["train"][-1]["loss"] < a["train"][0]["loss"]  # it learns


def test_dp2_lora_precomputed_packed_equals_one_process(tmp_path, base):
    extra = "  finetuning: lora\n  lora_rank: 4\n  lora_target_modules: all-linear\n  batching: packed\n"
    extra += "  precompute_ref_log_probs: true"
    one = _run(tmp_path, base, "one", 1, 1, "sigmoid", extra)
    dp2 = _run(tmp_path, base, "dp2", 2, 1, "sigmoid", extra)
    _same(one, dp2)
    assert one["train"][0]["rewards/margins"] == 0.0  # step 1: policy = reference (LoRA B = 0)
    assert one["train"][-1]["rewards/margins"] != 0.0
    assert "eval_rewards/accuracies" in one["summary"]


def test_tp2_full_frozen_copy_recompute_equals_one_process(tmp_path, base):
    extra = "  gradient_checkpointing: true"
    one = _run(tmp_path, base, "one", 1, 1, "ipo", extra)
    tp2 = _run(tmp_path, base, "tp2", 1, 2, "ipo", extra)
    _same(one, tp2)


def test_sharding_stage1_orpo_equals_one_process(tmp_path, base):
    one = _run(tmp_path, base, "one", 1, 1, "orpo", "")
    sharded = _run(tmp_path, base, "sharded", 1, 1, "orpo", "", sharding=2)
    _same(one, sharded)


CLIP = 0.05  # max_grad_norm below every step's gradient norm: the clip scales every update


PP_LORA = "\n  finetuning: lora\n  lora_rank: 4\n  lora_target_modules: all-linear\n  batching: packed"


PP_CASES = [("orpo", ""), ("sigmoid", "\n  precompute_ref_log_probs: true" + PP_LORA)]


def _clipped_against_one_process(tmp_path: Path, base: tuple, loss: str, extra: str, **layout: int) -> None:
    """The layout's run and one process's (max_seq_len ``seq``), max_grad_norm below every step's norm:
    per step loss, TRL's metrics, the clipped gradient norm and the eval loss equal."""
    extra = f"  max_grad_norm: {CLIP}" + extra
    seq = layout.pop("seq", 32)
    results = {}
    for name, shape in (("layout", layout), ("one", {})):
        for cached in (base[1] / ".bmtrain_cache").glob("ref_logps-*.npy"):
            cached.unlink()  # each run computes its reference log-probs (pp2: every rank, whole weights)
        results[name] = _run(tmp_path, base, name, 1, 1, loss, extra, seq=seq, **shape)
    one, got = results["one"], results["layout"]
    _same(one, got)
    norms = [r["grad_norm"] for r in one["train"]]
    assert min(norms) > CLIP
    np.testing.assert_allclose([r["grad_norm"] for r in got["train"]], norms, rtol=1e-5)


@pytest.mark.parametrize("loss, extra", PP_CASES)
def test_pp2_equals_one_process(tmp_path, base, loss, extra):
    """Pipeline parallel: the pair loss on the last stage from the logits, the sequence ids and the
    precomputed reference log-probs carried in the labels (orpo: full fine-tuning, one sequence per row;
    sigmoid: LoRA, reference = adapters off, packed pairs)."""
    _clipped_against_one_process(tmp_path, base, loss, extra, pp=2)


@pytest.mark.parametrize("loss, extra", PP_CASES)
def test_pp2_x_cp2_equals_one_process(tmp_path, base, loss, extra):
    """Pipeline beside context parallel: each stage runs the ring over its share of the rows, the last
    stage sums the shares' sequence log-probs over the context group and its first rank counts the pairs.
    Rows of 128 (orpo): the second rank's share (tokens 32-95) holds no response token of these short
    pairs, so it scores zeros and still joins the backward; packed rows of 32 (sigmoid): both shares score."""
    seq = 128 if loss == "orpo" else 32
    _clipped_against_one_process(tmp_path, base, loss, extra, pp=2, cp=2, seq=seq)


def test_resume_continues_exactly_against_the_starting_reference(tmp_path, base):
    """A resumed full fine-tuning run still compares against model_name_or_path (not the checkpoint it
    resumes from): its steps 3-4 equal the uninterrupted run's, rewards included."""
    import shutil

    text = DPO.format(
        base=base[0],
        data=base[1],
        out=tmp_path / "full",
        dp=1,
        tp=1,
        sharding=1,
        pp=1,
        cp=1,
        seq=32,
        loss="sigmoid",
        extra="",
    )
    text = text.replace("max_steps: 3", "max_steps: 4").replace("save_steps: 3", "save_steps: 2")
    cfg = tmp_path / "full.yaml"
    cfg.write_text(text.replace("eval_steps: 3", "eval_steps: 4"))
    _bmtrain("train", "--config", str(cfg))
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", out)
    shutil.rmtree(out / "checkpoints" / "step-4")
    (out / "checkpoints" / "latest").write_text("step-2\n")
    _bmtrain("train", "--config", str(cfg), "--output_dir", str(out), "--resume")

    def rows(d: Path) -> list:
        lines = (d / "metrics.jsonl").read_text().splitlines()
        return [{k: r[k] for k in KEYS} for r in map(json.loads, lines) if "loss" in r]

    assert rows(out) == rows(tmp_path / "full") and len(rows(out)) == 4
    assert rows(out)[-1]["rewards/margins"] != 0.0
