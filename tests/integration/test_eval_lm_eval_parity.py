"""`bmtrain eval --task mmlu` against lm-evaluation-harness: the same checkpoint (its `bmtrain export
--format hf` for lm-eval's hf model), the same local MMLU-layout files and few-shot setting give the same
accuracy, and each choice the same log-likelihood. Needs $BMTRAIN_REF_PYTHON with torch, transformers and
lm_eval; offline."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.fixtures.lm_eval_tasks import write_tasks
from tests.fixtures.make_benchmarks import write_all
from tests.unit.export.conftest import make_checkpoint

pytestmark = pytest.mark.slow
FEWSHOT = 2


def _ref_python() -> str:
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    if not ref or not Path(ref).exists():
        pytest.skip("set BMTRAIN_REF_PYTHON to a Python with torch, transformers and lm_eval")
    if subprocess.run([ref, "-c", "import lm_eval"], capture_output=True).returncode != 0:
        pytest.skip(f"{ref} has no lm_eval")
    return ref


def test_same_accuracy_and_loglikelihoods_as_lm_eval(tmp_path):
    ref = _ref_python()
    from bmtrain_cli.export.pipeline import export_checkpoint

    run = make_checkpoint(tmp_path / "ckpt")
    hf = tmp_path / "hf"
    export_checkpoint(str(run), str(hf), fmt="hf", log=lambda m: None)
    write_all(tmp_path / "bench")
    tasks = write_tasks(tmp_path / "bench" / "mmlu", tmp_path / "tasks")

    res = CliRunner().invoke(
        app,
        [
            "eval",
            "--model_path",
            str(run),
            "--task",
            "mmlu",
            "--data_path",
            str(tmp_path / "bench" / "mmlu"),
            "--num_fewshot",
            str(FEWSHOT),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    ours = json.loads(res.stdout.strip().splitlines()[-1])

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
        OMP_NUM_THREADS="1",
    )
    cmd = [
        ref,
        "-m",
        "lm_eval",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={hf},dtype=float32",
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(tmp_path / "tasks"),
        "--num_fewshot",
        str(FEWSHOT),
        "--device",
        "cpu",
        "--batch_size",
        "8",
        "--log_samples",
        "--output_path",
        str(tmp_path / "lm_out"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "lm_out").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]

    from bmtrain_cli.evaluation.layouts import read_task
    from bmtrain_cli.evaluation.tasks import build_requests
    from bmtrain_cli.export.any_model import load_model_and_tokenizer as _load
    from bmtrain_cli.models.scoring import sample_logps

    model, tok = _load(run, None, "float32")
    for subject in read_task("mmlu", tmp_path / "bench" / "mmlu"):
        task = f"local_mmlu_{subject.name}"
        assert ours["subjects"][subject.name]["acc"] == pytest.approx(theirs[task]["acc,none"])
        assert ours["subjects"][subject.name]["acc_norm"] == pytest.approx(theirs[task]["acc_norm,none"])
        (samples,) = (tmp_path / "lm_out").rglob(f"samples_{task}_*.jsonl")
        docs = sorted((json.loads(x) for x in samples.read_text().splitlines()), key=lambda d: d["doc_id"])
        lm_ll = np.array([r[0] for d in docs for r in d["filtered_resps"]], dtype=np.float64)
        mine = sample_logps(model, build_requests("mmlu", [subject], tok, FEWSHOT, 128))
        assert np.abs(mine - lm_ll).max() < 1e-3, (subject.name, np.abs(mine - lm_ll).max())
