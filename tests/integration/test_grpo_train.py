"""stage: grpo end to end on the tiny model (recipes/grpo.py): rollouts sampled from the policy, rewards,
TRL's metrics in metrics.jsonl and TensorBoard, a resumed run equal to an uninterrupted one, a reward
function that raises or returns the wrong length stopping the run, and a user's reward file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.tiny import model_yaml

GRPO = (
    model_yaml(max_seq_len=24, kv_heads=None, vocab_size=512)
    + """
train_config:
  stage: grpo
  demo_data: reverse
  output_dir: {out}
  overwrite_output_dir: true
  max_steps: {steps}
  micro_batch_size: 8
  learning_rate: 1.0e-3
  warmup_steps: 0
  logging_steps: 1
  save_steps: {save}
  report_to: [tensorboard]
  grpo:
    num_generations: 4
    max_completion_length: 8
    eval_prompts: 8
{grpo}
"""
)

ROLLOUT_KEYS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
    "time/rollout",
    "time/update",
)
LOSS_KEYS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


# a reward a fresh model's completions differ in (hardly any of them ends or gives the answer), so the
# advantages and the gradient are not zero
VOWELS = "def vowels(prompts, completions, **_):\n    return [sum(ch in 'aeiou' for ch in c) / 4 for c in completions]\n"


def _vowels(tmp_path: Path) -> str:
    path = tmp_path / "vowel_reward.py"
    path.write_text(VOWELS, encoding="utf-8")
    return f"{path}:vowels"


def _train(tmp_path: Path, name: str, steps: int = 3, save: int = 3, grpo: str = "", sets: tuple = ()):
    cfg = tmp_path / f"{name}.yaml"
    extra = grpo or "    reward_funcs: [accuracy, overlong]"
    cfg.write_text(GRPO.format(out=tmp_path / name, steps=steps, save=save, grpo=extra), encoding="utf-8")
    args = [a for kv in sets for a in ("--set", kv)]
    return CliRunner().invoke(app, ["train", "--config", str(cfg), *args], catch_exceptions=False)


def _rows(out: Path) -> list:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "loss" in r and "event" not in r]


def test_stage_grpo_trains_with_trl_metrics_in_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grpo = (
        f"    reward_funcs: [accuracy, overlong, {_vowels(tmp_path)}]\n    num_iterations: 2\n    beta: 0.05"
    )
    res = _train(tmp_path, "run", steps=3, grpo=grpo, sets=("train_config.finetuning=lora",))
    assert res.exit_code == 0, res.output
    assert "reference model: the policy with its LoRA adapters off" in res.output
    assert "held-out mean reward (greedy): before" in res.output
    assert "best eval reward" in res.output and "best eval loss" not in res.output
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]), r
        for key in ROLLOUT_KEYS + LOSS_KEYS + ("kl", "rewards/accuracy/mean", "rewards/vowels/mean"):
            assert key in r, key
        assert r["time/rollout"] >= 0 and r["time/update"] > 0
        assert 1 <= r["completions/mean_length"] <= 8
    # num_iterations 2: step 2 trains on step 1's rollouts (no new sampling), step 3 samples again
    assert rows[1]["reward"] == rows[0]["reward"] and rows[1]["time/rollout"] == 0.0
    assert rows[2]["time/rollout"] > 0
    # the second pass over a rollout batch moves away from the old policy: its KL is no longer zero
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "eval_reward" in summary and "before_eval_reward" in summary
    assert summary["best_eval_reward"] == -summary["best_eval_loss"]
    assert summary["best_eval_reward"] >= summary["eval_reward"]
    events = EventAccumulator(str(tmp_path / "run" / "logs"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("reward", "kl", "entropy", "rewards/accuracy/mean", "time/rollout", "time/update"):
        assert f"train/{key}" in tags, (key, sorted(tags))


def test_a_resumed_run_samples_and_trains_exactly_as_an_uninterrupted_one(tmp_path):
    grpo = f"    reward_funcs: [{_vowels(tmp_path)}]\n    num_iterations: 2"
    full = _train(tmp_path, "full", steps=5, save=3, grpo=grpo)
    assert full.exit_code == 0, full.output
    step3 = tmp_path / "full" / "checkpoints" / "step-3"
    state = json.loads((step3 / "trainer_state.json").read_text())["data"]
    assert state["served"] == 1 and state["buffer"] is not None  # saved half-way through a rollout batch
    resumed = _train(tmp_path, "resumed", steps=5, save=3, grpo=grpo, sets=(f"train_config.resume={step3}",))
    assert resumed.exit_code == 0, resumed.output
    want = {r["step"]: r for r in _rows(tmp_path / "full")}
    got = _rows(tmp_path / "resumed")
    assert [r["step"] for r in got] == [4, 5] and all(want[s]["grad_norm"] > 0 for s in (4, 5))
    for r in got:
        for key in ("loss", "grad_norm", "reward", "completions/mean_length", "entropy"):
            assert r[key] == want[r["step"]][key], (r["step"], key)


def test_a_reward_function_that_raises_or_miscounts_stops_the_run_with_its_name_and_record(tmp_path):
    rewards = tmp_path / "bad_rewards.py"
    rewards.write_text(
        "def picky(prompts, completions, answer, **_):\n"
        "    for a in answer:\n"
        "        if a:\n"
        "            raise ValueError('cannot score ' + a)\n"
        "    return [0.0] * len(completions)\n\n"
        "def short(prompts, completions, **_):\n"
        "    return [1.0] * (len(completions) - 1)\n",
        encoding="utf-8",
    )
    res = CliRunner().invoke(
        app,
        ["train", "--config", _config(tmp_path, f"    reward_funcs: [{rewards}:picky]")],
    )
    assert res.exit_code == 2, res.output
    assert "reward function picky raised ValueError: cannot score" in res.output and "'answer':" in res.output
    res = CliRunner().invoke(
        app, ["train", "--config", _config(tmp_path, f"    reward_funcs: [accuracy, {rewards}:short]")]
    )
    assert res.exit_code == 2, res.output
    assert "reward function short returned 7 values for 8 completions" in res.output, res.output
    assert not list((tmp_path / "bad").glob("checkpoints/step-*"))


def _config(tmp_path: Path, grpo: str) -> str:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(GRPO.format(out=tmp_path / "bad", steps=1, save=1, grpo=grpo), encoding="utf-8")
    return str(cfg)


def test_a_users_reward_file_outside_the_repo_scores_the_completions(tmp_path):
    rewards = tmp_path / "elsewhere" / "my_rewards.py"
    rewards.parent.mkdir()
    rewards.write_text(
        "def length(prompts, completions, answer, completion_lengths, **_):\n"
        "    assert len(prompts) == len(completions) == len(answer) == len(completion_lengths)\n"
        "    return [n / 10 for n in completion_lengths]\n",
        encoding="utf-8",
    )
    marker = tmp_path / "imported"
    rewards.write_text(f"open({str(marker)!r}, 'w').close()\n" + rewards.read_text(), encoding="utf-8")
    cfg = tmp_path / "user.yaml"
    grpo = f"    reward_funcs: [{rewards}:length]"
    cfg.write_text(GRPO.format(out=tmp_path / "user", steps=2, save=2, grpo=grpo), encoding="utf-8")
    checked = CliRunner().invoke(app, ["validate-config", str(cfg)])
    assert checked.exit_code == 0, checked.output
    assert not marker.exists()  # validate-config checks that the file exists, and runs none of it
    res = _train(tmp_path, "user", steps=2, save=2, grpo=grpo)
    assert res.exit_code == 0, res.output
    assert marker.exists()
    for r in _rows(tmp_path / "user"):
        assert r["rewards/length/mean"] == r["reward"]
        assert abs(r["reward"] - r["completions/mean_length"] / 10) < 1e-12


def test_grpo_on_a_quantised_base_with_gradient_checkpointing_trains_the_adapters(tmp_path):
    """QLoRA under GRPO: an nf4 base, LoRA on every projection and recomputed layers; the policy gradient
    reaches the adapters at every step and the checkpoint holds only them, with the quantisation recorded."""
    from safetensors.numpy import load_file

    sets = (
        "train_config.finetuning=lora",
        "train_config.lora_target_modules=all-linear",
        "train_config.gradient_checkpointing=true",
        "model_config.quantization.method=nf4",
        "model_config.quantization.block_size=16",
    )
    result = _train(tmp_path, "qlora", grpo=f"    reward_funcs: [{_vowels(tmp_path)}]", sets=sets)
    assert result.exit_code == 0, result.output
    rows = _rows(tmp_path / "qlora")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows), rows
    step = tmp_path / "qlora" / "checkpoints" / "step-3"
    adapters = load_file(str(step / "adapter_model.safetensors"))
    assert adapters and all("lora_" in name for name in adapters)
    assert any(abs(w).max() > 0 for name, w in adapters.items() if "lora_B" in name)  # B starts at zero
    assert not (step / "model.safetensors").exists()
    assert json.loads((step / "lora_base.json").read_text())["quantization"]["method"] == "nf4"
