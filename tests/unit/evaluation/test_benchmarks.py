"""`bmtrain eval --task`: the published layouts, lm-eval's prompts, and scores that match a one-sample,
full-logits computation of the same log-likelihoods."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.evaluation.layouts import read_task
from bmtrain_cli.evaluation.tasks import build_requests, context, score_subjects
from bmtrain_cli.models.scoring import next_token_loss_sum
from tests.fixtures.make_benchmarks import write_all
from tests.unit.export.conftest import make_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    write_all(out)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), steps=20)


@pytest.mark.parametrize("task", ["mmlu", "ceval", "cmmlu", "multiple_choice"])
def test_layouts_read_the_same_questions(bench, task):
    subjects = read_task(task, bench / task)
    assert [s.name for s in subjects] == ["addition", "subtraction", "two_digit_sums"]
    ref = read_task("mmlu", bench / "mmlu")
    for s, r in zip(subjects, ref):
        assert s.test == r.test and s.dev == r.dev and len(s.test) == 12 and len(s.dev) == 5


def test_one_subject_file_finds_its_dev_split(bench):
    (subject,) = read_task("mmlu", bench / "mmlu" / "test" / "addition_test.csv")
    assert subject.name == "addition" and len(subject.dev) == 5


def test_mmlu_prompt_is_lm_evals():
    from bmtrain_cli.evaluation.layouts import Question, Subject

    q = Question(" 1+1= ", ("2", "3", "4", "5"), 0)
    s = Subject("high_school_math", test=[q], dev=[Question("2+2=", ("1", "4", "5", "6"), 1)])
    assert context("mmlu", s, q, 1) == (
        "The following are multiple choice questions (with answers) about high school math.\n\n"
        "2+2=\nA. 1\nB. 4\nC. 5\nD. 6\nAnswer: B\n\n"
        "1+1=\nA. 2\nB. 3\nC. 4\nD. 5\nAnswer:"
    )


def test_scores_match_one_sample_full_logits(bench, run):
    from bmtrain_cli.export.any_model import load_model_and_tokenizer as _load

    model, tok = _load(run, None, "float32")
    subjects = read_task("mmlu", bench / "mmlu")
    requests = build_requests("mmlu", subjects, tok, 2, 128)
    assert len(requests) == 3 * 12 * 4
    ids, labels = requests[0]
    assert (labels != -100).sum() >= 1 and (labels[: len(ids) - 1] == -100).sum() > 0
    import paddle

    with paddle.no_grad():
        plain = np.array(
            [
                -next_token_loss_sum(model(paddle.to_tensor(i[None, :])).numpy()[0], lab)[0]
                for i, lab in requests
            ]
        )
    res = runner.invoke(
        app,
        [
            "eval",
            "--model_path",
            str(run),
            "--task",
            "mmlu",
            "--data_path",
            str(bench / "mmlu"),
            "--num_fewshot",
            "2",
            "--batch_size",
            "5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = score_subjects(subjects, plain)
    assert got["acc"] == pytest.approx(want["acc"]) and got["acc_norm"] == pytest.approx(want["acc_norm"])
    for name, s in want["subjects"].items():
        assert got["subjects"][name]["acc"] == pytest.approx(s["acc"])
    assert got["questions"] == 36 and got["num_fewshot"] == 2


def test_bad_input_is_one_line(bench, run, tmp_path):
    res = runner.invoke(
        app, ["eval", "--model_path", str(run), "--task", "mmlu", "--data_path", str(tmp_path)]
    )
    assert res.exit_code == 2 and "no mmlu questions" in res.output and "Traceback" not in res.output
    bad = tmp_path / "x_test.csv"
    bad.write_text("1+1=,2,3,4,5,E\n", encoding="utf-8")
    res = runner.invoke(app, ["eval", "--model_path", str(run), "--task", "mmlu", "--data_path", str(bad)])
    assert res.exit_code == 2 and "x_test.csv:1" in res.output, res.output
