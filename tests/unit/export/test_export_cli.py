"""`bmtrain export`: the success output and every error form (exit 2, a message, no traceback)."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app

runner = CliRunner()


def _run(*args):
    r = runner.invoke(app, ["export", *args])
    text = r.output + (r.stderr if r.stderr_bytes is not None else "")
    return r, text


@pytest.fixture
def step_copy(trained_run, tmp_path):
    """A private copy of the trained step-60 checkpoint to damage."""
    dst = tmp_path / "run" / "checkpoints" / "step-60"
    shutil.copytree(trained_run / "checkpoints" / "step-60", dst)
    return dst


def test_export_int8_hf_prints_ratio_and_eval_change(trained_run, heldout, tmp_path):
    out = tmp_path / "hf8"
    r, text = _run(
        "--checkpoint",
        str(trained_run / "checkpoints"),
        "--output",
        str(out),
        "--format",
        "hf",
        "--quantize",
        "int8",
        "--eval_data",
        heldout,
        "--max-eval-records",
        "50",
    )
    assert r.exit_code == 0, text
    assert "size ratio 0.2" in text  # about 0.27x: see docs/deploy.md
    assert "eval loss on" in text and "% relative" in text and "(50 records)" in text
    assert "model.embed_tokens" in text
    meta = json.loads((out / "bmtrain_export.json").read_text())
    assert meta["format"] == "hf" and meta["report"]["size_ratio"] <= 0.3
    # --overwrite replaces; without it the same command is refused
    r2, text2 = _run("--checkpoint", str(trained_run), "--output", str(out), "--format", "hf")
    assert (
        r2.exit_code == 2
        and "already exists" in text2
        and "--overwrite" in text2
        and "Traceback" not in text2
    )
    r3, text3 = _run("--checkpoint", str(trained_run), "--output", str(out), "--format", "hf", "--overwrite")
    assert r3.exit_code == 0, text3
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_missing_checkpoint(tmp_path):
    r, text = _run("--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2 and "does not exist" in text and "Traceback" not in text


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    r, text = _run("--checkpoint", str(tmp_path / "empty"), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2 and "is not a checkpoint" in text


def test_checkpoints_dir_without_complete_step(tmp_path):
    ck = tmp_path / "run" / "checkpoints" / "step-5"
    ck.mkdir(parents=True)  # a save that never finished: no trainer_state.json
    r, text = _run("--checkpoint", str(tmp_path / "run"), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2 and "no complete checkpoint" in text


@pytest.mark.parametrize(
    "damage, message",
    [
        ("trainer_state.json", "partial checkpoint (no trainer_state.json"),
        ("config.json", "partial checkpoint (no config.json)"),
        ("model.safetensors", "no model weights"),
        ("tokenizer.model", "partial checkpoint (no tokenizer file"),
        ("truncate", "unreadable or truncated weights"),
        ("shard", "missing weight shard(s) model-00002-of-00002.safetensors"),
    ],
)
def test_partial_checkpoint(step_copy, tmp_path, damage, message):
    if damage == "truncate":
        f = step_copy / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-1000])
    elif damage == "shard":
        index = {
            "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
        }
        (step_copy / "model.safetensors.index.json").write_text(json.dumps(index))
        (step_copy / "model.safetensors").rename(step_copy / "model-00001-of-00002.safetensors")
    else:
        (step_copy / damage).unlink()
    r, text = _run("--checkpoint", str(step_copy), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2, text
    assert message in text and "Traceback" not in text
    assert not (tmp_path / "o").exists()


def test_unknown_format_and_quantization(trained_run, tmp_path):
    r, text = _run("--checkpoint", str(trained_run), "--output", str(tmp_path / "o"), "--format", "onnx")
    assert r.exit_code == 2 and "unknown export format 'onnx'" in text and "paddle-inference, hf" in text
    r, text = _run("--checkpoint", str(trained_run), "--output", str(tmp_path / "o"), "--quantize", "int4")
    assert r.exit_code == 2 and "unknown --quantize 'int4'" in text


def test_output_is_a_file(trained_run, tmp_path):
    (tmp_path / "o").write_text("x")
    r, text = _run("--checkpoint", str(trained_run), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2 and "is not a directory" in text


def test_missing_eval_data(trained_run, tmp_path):
    r, text = _run(
        "--checkpoint",
        str(trained_run),
        "--output",
        str(tmp_path / "o"),
        "--quantize",
        "int8",
        "--eval_data",
        str(tmp_path / "none.jsonl"),
    )
    assert r.exit_code == 2 and "does not exist" in text


def test_lora_checkpoint_without_base_is_a_user_error(tmp_path):
    """An adapters-only directory goes to the LoRA merge hook; one naming no base model is a clean error."""
    d = tmp_path / "lora-step"
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    r, text = _run("--checkpoint", str(d), "--output", str(tmp_path / "o"))
    assert r.exit_code == 2, text
    assert "Traceback" not in text and not (tmp_path / "o").exists()


def test_export_into_training_state_is_refused(trained_run, tmp_path):
    """`export --checkpoint RUN/checkpoints/step-60 --output RUN/checkpoints/step-60 --overwrite` deleted
    the optimizer state and trainer_state.json; --resume then continued from an older step silently."""
    from tests.tree import tree_digest

    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    step = run / "checkpoints" / "step-60"
    before = tree_digest(run)
    other = tmp_path / "other-run"
    shutil.copytree(trained_run, other)
    for output in (step, run, run / "checkpoints", step / "hf", other, other / "checkpoints" / "step-60"):
        r, text = _run("--checkpoint", str(step), "--output", str(output), "--format", "hf", "--overwrite")
        assert r.exit_code == 2, (output, text)
        assert "--output" in text and "Traceback" not in text
        assert tree_digest(run) == before
    assert (other / "checkpoints" / "step-60" / "trainer_state.json").is_file()
