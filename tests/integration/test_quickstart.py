"""The quickstart as a user runs it: `bmtrain train --config configs/quickstart.yaml`, then the LoRA second
stage `configs/llama-tiny-lora.yaml` and the GRPO stage `configs/quickstart-grpo.yaml` on its checkpoints,
and `bmtrain chat` on its output as the README shows.
Slow (about a minute per stage on 2 cores): held-out accuracy must rise clearly in each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]


def _train(config: str, out: Path, *sets: str) -> dict:
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", config]
    for s in (f"train_config.output_dir={out}", *sets):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "held-out accuracy: before" in proc.stdout
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qs") / "quickstart"
    summary = _train("configs/quickstart.yaml", out)
    assert summary["accuracy_before"] <= 0.05
    assert summary["accuracy_after"] >= 0.6, summary
    assert (out / "checkpoints" / "step-120" / "config.json").is_file()
    held = [json.loads(x) for x in (out / "data" / "heldout.jsonl").read_text().splitlines()]
    train = {json.loads(x)["input"] for x in (out / "data" / "train.jsonl").read_text().splitlines()}
    assert not {r["input"] for r in held} & train
    return out


def test_quickstart_learns(quickstart):
    summary = json.loads((quickstart / "summary.json").read_text())
    assert summary["steps"] == 120 and summary["final_loss"] < 0.5


def test_lora_second_stage_learns_new_task(quickstart, tmp_path):
    base = quickstart / "checkpoints" / "step-120"
    summary = _train(
        "configs/llama-tiny-lora.yaml", tmp_path / "lora", f"model_config.model_name_or_path={base}"
    )
    assert summary["accuracy_before"] <= 0.05  # the base reverses; the task is rotate
    assert summary["accuracy_after"] >= 0.5, summary


def test_grpo_demo_raises_held_out_reward(quickstart, tmp_path):
    """configs/quickstart-grpo.yaml as shipped, from the quickstart's half-way checkpoint: the greedy
    held-out reward (exact reversals, the only signal the policy gets) rises clearly."""
    start = quickstart / "checkpoints" / "step-60"
    summary = _train(
        "configs/quickstart-grpo.yaml", tmp_path / "grpo", f"model_config.model_name_or_path={start}"
    )
    assert summary["before_eval_reward"] <= 0.4, summary  # half-trained: most reversals wrong
    assert summary["eval_reward"] >= summary["before_eval_reward"] + 0.25, summary
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.25, summary


def test_chat_on_the_demo_checkpoint_answers_as_the_readme_says(quickstart):
    """README's next step `bmtrain chat --model_path output/quickstart`: typing kqzfa= gets afzqk (stdin
    piped: one reply per line, then the session ends)."""
    cmd = [sys.executable, "-m", "bmtrain_cli", "chat", "--model_path", str(quickstart)]
    r = subprocess.run(cmd, input="kqzfa=\n", cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("\n")[0] == "afzqk", r.stdout
