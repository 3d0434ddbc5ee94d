"""Dynamic pipeline load balancing: under pp2 one decoder layer is slowed (a copied recipe sleeps in its
forward), the stage boundaries move at the step-4 checkpoint (log line, metrics.jsonl event), training
continues, and every step's loss and gradient norm equal one process (1e-5 relative) with clipping active.

The quickstart model with 6 decoder layers (tied embeddings), 8 steps of a global batch of 8 in 4
micro-batches. The uniform cut puts layers 0-2 on stage 0 and 3-5 (with the slow layer 5) on stage 1;
the measured cut leaves layer 5 alone with the norm and head.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
RECIPE = REPO / "tests" / "integration" / "rebalance_scripts" / "slow_layer_recipe.py"
STEPS = 8
COMMON = [
    "model_config.num_hidden_layers=6",
    f"train_config.max_steps={STEPS}",
    "train_config.warmup_steps=0",
    "train_config.micro_batch_size=2",
    "train_config.global_batch_size=8",
    "train_config.logging_steps=1",
    "train_config.save_steps=4",
    "train_config.eval_steps=null",
]
REBALANCE = [
    "parallel_config.pipeline_parallel=2",
    "parallel_config.pipeline_rebalance.enabled=true",
    "parallel_config.pipeline_rebalance.check_every=2",
    "parallel_config.pipeline_rebalance.threshold=1.2",
]


def _rows(out: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps(rows: List[Dict[str, Any]]) -> Dict[str, np.ndarray]:
    steps = [r for r in rows if "loss" in r and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}


def _one_process(out: Path) -> Dict[str, np.ndarray]:
    sets = [x for o in COMMON for x in ("--set", o)]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bmtrain_cli",
            "train",
            "--config",
            str(QUICKSTART),
            *sets,
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return _steps(_rows(out))


def _pp2_slowed(out: Path) -> str:
    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.parallel.launch import plan_launch

    overrides = COMMON + REBALANCE + [f"train_config.output_dir={out}"]
    loaded = load_config(str(QUICKSTART), overrides, mode="train")
    args = ["--config", str(QUICKSTART)] + [x for o in overrides for x in ("--set", o)]
    plan = plan_launch(loaded.config, args, script=str(RECIPE), has_gpu=False)
    res = subprocess.run(
        plan.command,
        env={**__import__("os").environ, **plan.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = (Path(plan.log_dir) / "workerlog.0").read_text(errors="replace")
    assert res.returncode == 0, log[-4000:] + res.stderr[-2000:]
    return log


def test_a_slowed_stage_is_rebalanced_and_training_continues_exactly(tmp_path):
    want = _one_process(tmp_path / "single")
    log = _pp2_slowed(tmp_path / "pp2")
    rows = _rows(tmp_path / "pp2")

    events = [r for r in rows if r.get("event") == "pipeline_rebalance"]
    assert len(events) == 1, events
    event = events[0]
    assert event["step"] == 4  # the first checkpoint after the step-2 check found the stages unequal
    assert event["old_stage_layers"] == [[0, 1, 2], [3, 4, 5]]
    assert event["new_stage_layers"] == [[0, 1, 2, 3, 4], [5]]
    assert event["imbalance"] > 1.2 and event["predicted_imbalance"] < event["imbalance"]
    assert (
        "pipeline rebalanced: decoder layers per stage [[0, 1, 2], [3, 4, 5]] -> [[0, 1, 2, 3, 4], [5]]"
        in log
    )

    got = _steps(rows)
    assert np.all(want["grad_norm"] > 1.0)  # max_grad_norm 1.0: the clip scales every step
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert want["loss"][-1] < want["loss"][0]

    # the last checkpoint's per-stage optimizer parts are marked with the cut they belong to
    state = json.loads(
        (tmp_path / "pp2" / "checkpoints" / f"step-{STEPS}" / "trainer_state.json").read_text()
    )
    assert state["optimizer_layout"]["pipeline_bounds"] == [0, 6, 9]
