"""Offload as plan counts it and as training applies it: parameter offload needs group-sharded stage 3
(sharding_parallel > 1), so validate-config refuses it on one device and plan counts no saving for it;
every offload combination `plan --search` proposes is one training applies, and the one-device
combination (optimizer offload) trains here."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import yaml

from bmtrain_cli.config import load_config
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.estimator import Layout, Workload, estimate_layout
from bmtrain_cli.plan.search import enumerate_layouts
from tests.tiny import model_dict

SEVEN_B = "configs/llama2-7b-sft-8gpu.yaml"


def _one_card_7b(repo_root: Path, tmp_path: Path, **parallel) -> Path:
    cfg = yaml.safe_load((repo_root / SEVEN_B).read_text(encoding="utf-8"))
    par = "parallel" if "parallel" in cfg else "parallel_config"
    train = cfg["train" if "train" in cfg else "train_config"]
    cfg[par] = {"data_parallel": 1, "tensor_parallel": 1, **parallel}
    train["global_batch_size"] = train["micro_batch_size"]
    path = tmp_path / "one-card.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def _line_of(path: Path, key: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(key))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True)


def test_validate_and_plan_refuse_parameter_offload_on_one_device(repo_root, tmp_path):
    path = _one_card_7b(repo_root, tmp_path, sharding_stage=3, offload_params=True)
    for cmd in (["validate-config", str(path)], ["plan", "--config", str(path), "--device", "RTX4090"]):
        res = _cli(*cmd)
        text = res.stdout + res.stderr
        assert res.returncode == 2, text
        assert f"{path}:{_line_of(path, 'offload_params')}" in text
        assert "needs sharding_parallel > 1" in text and "offload_optimizer: true" in text
        assert "Traceback" not in text


def test_plan_counts_no_saving_for_parameter_offload_without_group_sharding(repo_root, tmp_path):
    config = load_config(str(_one_card_7b(repo_root, tmp_path))).config
    w = Workload.from_config(config, read_data=False)
    card = get_device("RTX4090")
    plain = estimate_layout(w, Layout(stage=3), card)
    claimed = estimate_layout(w, Layout(stage=3, offload_params=True), card)
    assert claimed.peak == plain.peak and claimed.parameters == plain.parameters
    assert claimed.host_bytes == 0 and not claimed.fits  # LLaMA-2-7B full fine-tuning on one 24 GB card
    assert any("not counted" in n for n in claimed.notes)
    # with group-sharded stage 3 the saving is real and counted
    sharded = estimate_layout(w, Layout(sharding=8, stage=3, offload_params=True), card)
    assert (
        sharded.host_bytes > 0
        and sharded.parameters < estimate_layout(w, Layout(sharding=8, stage=3), card).parameters
    )


def test_search_proposes_only_offloads_training_applies(repo_root):
    w = Workload.from_config(load_config(str(repo_root / SEVEN_B)).config, read_data=False)
    card = get_device("A100-80GB")
    seen = set()
    for world in (1, 2, 8):
        for lay in enumerate_layouts(w, world, card):
            group_sharded = lay.sharding > 1 and lay.stage == 3
            if lay.offload_params:
                assert group_sharded, lay  # Paddle's group-sharded stage 3 offloads the parameters
            if lay.offload_optimizer:
                # one device: our OffloadOptimizer (train/optimizer/offload.py); else group-sharded offload
                assert world == 1 or group_sharded, lay
            seen.add((world, lay.offload_optimizer, lay.offload_params))
    assert (1, True, False) in seen and (8, True, True) in seen
    assert not any(par for world, _, par in seen if world == 1)


def test_one_device_optimizer_offload_trains(repo_root, tmp_path):
    """The offload plan counts on one device: training applies it (the optimizer is the host-state
    OffloadOptimizer) and the run trains."""
    from bmtrain_cli.train.optimizer.offload import OffloadOptimizer
    from bmtrain_cli.train.run import load_recipe

    data = tmp_path / "train.jsonl"
    rows = [{"input": f"add {i} and {i + 3}", "output": str(2 * i + 3)} for i in range(32)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = {
        "model_config": model_dict(),
        "train_config": {
            "data_path": str(data),
            "output_dir": str(tmp_path / "out"),
            "max_steps": 3,
            "micro_batch_size": 4,
            "learning_rate": 3.0e-3,
            "warmup_steps": 1,
            "logging_steps": 1,
            "save_steps": 100,
            "num_workers": 0,
        },
        "parallel_config": {"offload_optimizer": True},
    }
    path = tmp_path / "offload.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    parts, state = load_recipe("sft").setup(load_config(str(path), mode="train"), stream=io.StringIO())
    assert isinstance(parts.optim.base, OffloadOptimizer)
    summary = load_recipe("sft").train(parts, state)
    assert summary["steps"] == 3 and summary["final_loss"] == summary["final_loss"]  # ran, finite
