"""lm-evaluation-harness's `bmtrain` model on a checkpoint (no export): lm-eval's own task machinery over
the local MMLU-layout files gives the accuracy `bmtrain eval --task mmlu` gives. Needs lm_eval in this
interpreter (the lm-eval extra)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.fixtures.lm_eval_tasks import write_tasks
from tests.fixtures.make_benchmarks import write_all
from tests.unit.export.conftest import make_checkpoint

pytestmark = pytest.mark.slow


def test_bmtrain_model_matches_bmtrain_eval(tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    from lm_eval.tasks import TaskManager

    import bmtrain_cli.evaluation.lm_eval_model  # noqa: F401  (registers "bmtrain")

    run = make_checkpoint(tmp_path / "ckpt", steps=20)
    write_all(tmp_path / "bench")
    tasks = write_tasks(tmp_path / "bench" / "mmlu", tmp_path / "tasks")
    out = lm_eval.simple_evaluate(
        model="bmtrain",
        model_args=f"path={run},batch_size=4",
        tasks=tasks,
        num_fewshot=1,
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
    )
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
            "1",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    ours = json.loads(res.stdout.strip().splitlines()[-1])
    for task in tasks:
        subject = task[len("local_mmlu_") :]
        assert out["results"][task]["acc,none"] == pytest.approx(ours["subjects"][subject]["acc"])
