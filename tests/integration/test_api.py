"""The Python API on user models under the launcher equals one process (CPU, gloo).

recipes/custom_model.py (a Sequential of embedding, MLP blocks, norm and head; AdamW with a global-norm
clip that is active from step 2) runs 4 steps in one process and under dp2, tp2, pp2, dp2 x tp2 and sharding stage 1 x2; every
step's loss must equal the single process's to 1e-5 relative, and under tp2 the wrapped model's outputs
the whole model's. api_scripts/layerlist_worker.py (layers in one LayerList, an explicit plan with a
gathered column head, the measured partition, the loss given to PipelineParallel only, SGD with clipping)
runs under tp2 x pp2 against one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "custom_model.py"
LAYERLIST = Path(__file__).parent / "api_scripts" / "layerlist_worker.py"


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _run(tmp: Path, name: str, nproc: int, script: Path, *args: str) -> dict:
    out = tmp / f"{name}.json"
    args = tuple(a.replace("{out}", str(out)) for a in args)
    if nproc == 1:
        cmd = [sys.executable, str(script), *args]
    else:
        log_dir = tmp / f"log-{name}"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc),
               "--log_dir", str(log_dir), str(script), *args]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=str(tmp))
    if res.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp / f"log-{name}").glob("workerlog.*")))
        raise AssertionError(
            f"{name} failed ({res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}\n{logs}"
        )
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-single")
    return _run(tmp, "single", 1, RECIPE, "--steps", "4", "--out", "{out}")["losses"]


@pytest.mark.parametrize(
    "name,nproc,args",
    [
        ("dp2", 2, []),
        ("tp2", 2, ["--tensor_parallel", "2"]),
        ("pp2", 2, ["--pipeline_parallel", "2"]),
        ("dp2tp2", 4, ["--tensor_parallel", "2"]),
        ("sharding2", 2, ["--sharding_parallel", "2"]),
    ],
)
def test_recipe_layouts_match_one_process(tmp_path, single, name, nproc, args):
    result = _run(tmp_path, name, nproc, RECIPE, "--steps", "4", "--out", "{out}", *args)
    assert len(single) == 4 and single[3] < single[0] - 1.0  # it trains
    np.testing.assert_allclose(result["losses"], single, rtol=1e-5)
    if "--tensor_parallel" in args:
        assert result["tp_output_max_diff"] < 1e-5
    if name == "pp2":
        assert result["pipeline"]["boundaries"] == [
            0,
            2,
            5,
        ]  # uniform: embedding + block | block + norm + head


def test_layerlist_model_with_plan_tp2_pp2_matches_one_process(tmp_path):
    want = _run(tmp_path, "ll-single", 1, LAYERLIST, "{out}", "1", "1")
    got = _run(tmp_path, "ll-tp2pp2", 4, LAYERLIST, "{out}", "2", "2")
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    assert got["pipeline"]["method"] == "measured" and len(got["pipeline"]["boundaries"]) == 3
