"""QLoRA under data parallel: dp2 through `bmtrain run` logs the single process's per-step loss and
grad_norm (1e-5 relative) with LoRA on an nf4-quantised base, with the gradient clip firing every step
(the quickstart model, max_grad_norm 1.0, settings of tests/integration/test_parallel_matrix.py). Each rank
quantises the same whole base; tensor and pipeline parallel stay refused by validate-config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest

from tests.integration.test_parallel_matrix import COMMON, QUICKSTART, STEPS

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

QLORA = [
    "train_config.finetuning=lora",
    "train_config.lora_target_modules=all-linear",
    "model_config.quantization.method=nf4",
    "model_config.quantization.block_size=32",
]


def _run(out: Path, layout: List[str]) -> Dict[str, np.ndarray]:
    sets = [x for o in COMMON + QLORA + layout for x in ("--set", o)]
    cmd = [sys.executable, "-m", "bmtrain_cli", "run" if layout else "train", "--config", str(QUICKSTART)]
    res = subprocess.run(cmd + sets + ["--output_dir", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    logs = res.stdout + "".join(p.read_text() for p in out.rglob("workerlog.*"))
    assert "quantised base: " in logs and "linear layers in nf4" in logs, logs[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}


def test_qlora_dp2_matches_one_process(tmp_path):
    want = _run(tmp_path / "single", [])
    assert np.all(want["grad_norm"] > 1.0), want  # max_grad_norm 1.0: the clip scales every step
    assert want["loss"][-1] < want["loss"][0]
    got = _run(tmp_path / "dp2", ["parallel_config.data_parallel=2"])
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
