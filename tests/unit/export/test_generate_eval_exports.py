"""`bmtrain generate` and `bmtrain eval` open both exported formats (and INT8) like a checkpoint."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.export.pipeline import export_checkpoint

runner = CliRunner()


@pytest.fixture(scope="module")
def models(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("gen_exports")
    ckpt = trained_run / "checkpoints" / "step-60"
    paths = {"checkpoint": ckpt}
    for fmt, q in (("paddle-inference", None), ("hf", "int8"), ("paddle-inference", "int8")):
        name = f"{fmt}-{q}"
        export_checkpoint(str(ckpt), str(out / name), fmt=fmt, quantize=q, log=lambda m: None)
        paths[name] = out / name
    return paths


def _cmd(*args):
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.stdout


def test_generate_same_greedy_text_from_exports(models):
    texts = {
        k: _cmd("generate", "--model_path", str(p), "--prompt", "12+35=", "--max_new_tokens", "6").strip()
        for k, p in models.items()
    }
    assert texts["paddle-inference-None"] == texts["checkpoint"]
    assert texts["hf-int8"] == texts["paddle-inference-int8"]


def test_eval_loss_matches_across_formats(models, heldout, tmp_path):
    small = tmp_path / "heldout-60.jsonl"
    with open(heldout, encoding="utf-8") as f:
        small.write_text("".join(f.readlines()[:60]), encoding="utf-8")
    res = {
        k: json.loads(_cmd("eval", "--model_path", str(p), "--data_path", str(small), "--json"))
        for k, p in models.items()
    }
    ref = res["checkpoint"]
    assert res["paddle-inference-None"]["tokens"] == ref["tokens"] > 0
    assert res["paddle-inference-None"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert res["hf-int8"]["loss"] == pytest.approx(res["paddle-inference-int8"]["loss"], rel=1e-5)
    assert res["hf-int8"]["loss"] == pytest.approx(ref["loss"], rel=0.02)


def test_eval_json_stdout_is_one_json_object_for_paddle_inference(models, heldout, tmp_path):
    """Paddle Inference's oneDNN passes print to the C++ stdout on the first run; `bmtrain eval --json`
    must still print exactly one JSON object on stdout (a real process: CliRunner sees Python's stdout
    only, not file descriptor 1)."""
    import subprocess
    import sys

    small = tmp_path / "heldout-8.jsonl"
    with open(heldout, encoding="utf-8") as f:
        small.write_text("".join(f.readlines()[:8]), encoding="utf-8")
    path = models["paddle-inference-int8"]
    cmd = [sys.executable, "-m", "bmtrain_cli", "eval", "--model_path", str(path), "--data_path", str(small)]
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["tokens"] > 0 and result["loss"] > 0


def test_eval_accepts_a_run_dir_and_its_checkpoints_dir(models, trained_run, heldout, tmp_path):
    """--model_path may name the run's output_dir or its checkpoints dir (the latest step is used), as
    for `bmtrain export`."""
    small = tmp_path / "heldout-8.jsonl"
    with open(heldout, encoding="utf-8") as f:
        small.write_text("".join(f.readlines()[:8]), encoding="utf-8")
    res = [
        json.loads(_cmd("eval", "--model_path", str(p), "--data_path", str(small), "--json"))["loss"]
        for p in (models["checkpoint"], trained_run, trained_run / "checkpoints")
    ]
    assert res[1] == res[0] and res[2] == res[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_paddle_inference_export_is_one_line(models, heldout, tmp_path, damage):
    """A truncated or garbage model.pdiparams gave Paddle's traceback and exit 1 in generate and eval."""
    import shutil

    bad = tmp_path / "export"
    shutil.copytree(models["paddle-inference-None"], bad)
    params = bad / "model.pdiparams"
    data = params.read_bytes()
    params.write_bytes(data[: len(data) // 2] if damage == "truncated" else bytes(range(256)) * 64)
    for args in (["generate", "--prompt", "1+2="], ["eval", "--data_path", heldout]):
        r = runner.invoke(app, [args[0], "--model_path", str(bad), *args[1:]])
        assert r.exit_code == 2, r.output
        assert str(bad) in r.output and "the export is truncated or damaged" in r.output, r.output
        assert "Traceback" not in r.output


def test_generate_top_p_zero_is_greedy_and_max_new_tokens_is_capped(models):
    """--top_p 0 --temperature 1 raised `Probabilities contain NaN`; --max_new_tokens 100000 ran past the
    model's positions without a word."""
    ckpt = str(models["checkpoint"])
    greedy = _cmd("generate", "--model_path", ckpt, "--prompt", "12+35=", "--max_new_tokens", "6")
    top0 = _cmd(
        "generate",
        "--model_path",
        ckpt,
        "--prompt",
        "12+35=",
        "--max_new_tokens",
        "6",
        "--top_p",
        "0",
        "--temperature",
        "1",
    )
    assert top0 == greedy
    r = runner.invoke(
        app, ["generate", "--model_path", ckpt, "--prompt", "12+35=", "--max_new_tokens", "100000"]
    )
    assert r.exit_code == 0, r.output
    assert "--max_new_tokens 100000 capped at" in r.output and "max_position_embeddings 128" in r.output
    r = runner.invoke(app, ["generate", "--model_path", ckpt, "--prompt", "1", "--temperature", "nan"])
    assert r.exit_code == 2 and "Traceback" not in r.output  # the option's range refuses nan


def test_export_and_generate_show_no_paddle_internals(models, trained_run, tmp_path):
    """`bmtrain export --format paddle-inference` and `bmtrain generate` on the export, as real processes:
    none of Paddle's internal notices (jit.save's 'place' UserWarning, PIR's "not support input out
    tensor", the oneDNN pass's ReduceMeanCheckIfOneDNNSupport) reach the terminal."""
    import subprocess
    import sys

    noise = (
        "place' interface",
        "not support input out tensor",
        "ReduceMeanCheckIfOneDNNSupport",
        "warnings.warn",
    )
    out = tmp_path / "served"
    ckpt = trained_run / "checkpoints" / "step-60"
    base = [sys.executable, "-m", "bmtrain_cli"]
    for argv in (
        ["export", "--checkpoint", str(ckpt), "--output", str(out), "--format", "paddle-inference"],
        ["generate", "--model_path", str(out), "--prompt", "12+35=", "--max_new_tokens", "6"],
    ):
        r = subprocess.run([*base, *argv], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [n for n in noise if n in r.stdout + r.stderr], r.stderr[-2000:]
