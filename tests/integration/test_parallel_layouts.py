"""Multi-process equivalence of the parallel layouts against one process (CPU, gloo).

Each layout trains the same tiny decoder on the same 8 rows for 3 AdamW steps through ParallelContext
(fleet layers, the CPU compatibility layer, PipelineLayer 1F1B, fleet's sharding optimizer) and must log
the single-process losses to 1e-5 relative. The tp2 run also saves a layout-independent checkpoint that
load_pretrained reads in one process and a tp2 run loads back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "parallel_scripts" / "layout_worker.py"


def _launch(tmp: Path, name: str, nproc: int, par: dict, *extra: str) -> dict:
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(nproc),
        "--log_dir",
        str(tmp / f"log-{name}"),
        str(WORKER),
        "--out",
        str(out),
        "--par",
        json.dumps(par),
        *extra,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if res.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp / f"log-{name}").glob("workerlog.*")))
        raise AssertionError(f"{name} failed ({res.returncode}):\n{res.stderr[-2000:]}\n{logs}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    out = tmp / "single.json"
    subprocess.run([sys.executable, str(WORKER), "--single", "--out", str(out)], check=True, timeout=120)
    return json.loads(out.read_text())["losses"], dict(np.load(str(out) + ".npz"))


def _assert_same_losses(got, want):
    assert len(got) == len(want) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert want[2] < want[0]  # it trains


@pytest.mark.parametrize(
    "name,nproc,par",
    [
        ("dp2", 2, {"data_parallel": 2}),
        ("pp2", 2, {"pipeline_parallel": 2}),
        ("sharding2", 2, {"sharding_parallel": 2, "sharding_stage": 1}),
        ("dp2tp2", 4, {"data_parallel": 2, "tensor_parallel": 2}),
    ],
)
def test_layout_matches_single_process(tmp_path, reference, name, nproc, par):
    result = _launch(tmp_path, name, nproc, par)
    _assert_same_losses(result["losses"], reference[0])
    assert result["gathered_model_ok"]
    if name == "pp2":
        assert result["pipeline"]["boundaries"][0] == 0 and result["pipeline"]["imbalance"] >= 1.0


def test_tp2_matches_and_its_checkpoint_is_layout_independent(tmp_path, reference):
    from bmtrain_cli.models import load_pretrained

    ckpt = tmp_path / "tp2-ckpt"
    result = _launch(tmp_path, "tp2", 2, {"tensor_parallel": 2}, "--save_dir", str(ckpt))
    _assert_same_losses(result["losses"], reference[0])
    assert result["gathered_model_ok"]
    # whole tensors in Hugging Face layout: one process loads them and gets the single-process weights
    model = load_pretrained(str(ckpt), kernels="reference")
    final_single = reference[1]
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value.numpy(), final_single[name], rtol=1e-3, atol=2e-5)
    # and a tp2 run loads them back (split again) and continues from the same weights
    again = _launch(tmp_path, "tp2-load", 2, {"tensor_parallel": 2}, "--load_dir", str(ckpt))
    single_again = _launch(tmp_path, "dp1-load", 1, {}, "--load_dir", str(ckpt))
    np.testing.assert_allclose(again["losses"], single_again["losses"], rtol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "topk", "threshold"])
def test_gradient_compression_loss_within_one_percent(tmp_path, reference, kind):
    par = {"data_parallel": 2, "gradient_compression": kind, "topk_ratio": 0.3, "compression_threshold": 1e-3}
    result = _launch(tmp_path, kind, 2, par)
    assert abs(result["losses"][-1] / reference[0][-1] - 1) < 0.01
    stats = result["compression"]
    assert stats["bytes_sent"] > 0 and stats["bytes_dense"] / stats["bytes_sent"] > 1.5
