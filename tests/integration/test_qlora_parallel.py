"""QLoRA under data parallel: dp2 through `bmtrain run` logs the single process's per-step loss and
grad_norm (1e-5 relative) with LoRA on an nf4-quantised base, with the gradient clip firing every step
(the quickstart model, max_grad_norm 1.0, settings of tests/integration/test_parallel_matrix.py). Each rank
quantises the same whole base. Under tensor parallel (tp2) each rank quantises its own shards of the column-
and row-parallel projections, and the run equals the single process the same way: the model's MLP is 384
wide so that nf4's blocks of 64 never straddle a shard (192 inputs per row shard of down_proj), and the
shards' codes are the whole weight's. Under pipeline parallel (pp2) each rank quantises the base and
keeps its stage's layers; the checkpoint gathers the stages' dequantised weights."""

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


# tp2: shards of whole nf4 blocks (block_size 64 divides 384 / 2 and 128 / 2); int8 as well (its row-
# parallel scale is the group's maximum over the whole row)
TP_MODEL = ["model_config.intermediate_size=384", "model_config.quantization.block_size=64"]


def _run(out: Path, layout: List[str], quant: List[str] = QLORA) -> Dict[str, np.ndarray]:
    sets = [x for o in COMMON + quant + layout for x in ("--set", o)]
    cmd = [sys.executable, "-m", "bmtrain_cli", "run" if layout else "train", "--config", str(QUICKSTART)]
    res = subprocess.run(cmd + sets + ["--output_dir", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    logs = res.stdout + "".join(p.read_text() for p in out.rglob("workerlog.*"))
    method = next(o for o in quant if o.startswith("model_config.quantization.method=")).split("=")[1]
    assert "quantised base: " in logs and f"linear layers in {method}" in logs, logs[-3000:]
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


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_qlora_tp2_matches_one_process(tmp_path, method):
    quant = [o for o in QLORA if "quantization" not in o] + [f"model_config.quantization.method={method}"]
    quant += TP_MODEL if method == "nf4" else TP_MODEL[:1]
    want = _run(tmp_path / "single", [], quant)
    assert np.all(want["grad_norm"] > 1.0), want  # the clip fires every step
    assert want["loss"][-1] < want["loss"][0]
    got = _run(tmp_path / "tp2", ["parallel_config.tensor_parallel=2"], quant)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def test_qlora_pp2_matches_one_process(tmp_path):
    want = _run(tmp_path / "single", [])
    assert np.all(want["grad_norm"] > 1.0), want
    got = _run(tmp_path / "pp2", ["parallel_config.pipeline_parallel=2"])
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    saved = tmp_path / "pp2" / "checkpoints" / "step-4"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
