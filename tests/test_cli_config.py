"""CLI: validate-config and schema through Typer's runner and as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from bmtrain_cli import __version__
from bmtrain_cli.cli import app

runner = CliRunner()


def test_version_and_help():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and __version__ in r.output
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "validate-config" in r.output
    for cmd in ("validate-config", "schema"):
        assert runner.invoke(app, [cmd, "--help"]).exit_code == 0


def test_every_command_has_help():
    names = [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]
    assert {"train", "run", "prepare-data", "data-stats", "validate-config", "schema"} <= set(names)
    for cmd in names:
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "Usage" in r.output, (cmd, r.output)


def test_fresh_model_vocab_is_said_to_be_assumed(repo_root):
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/quickstart.yaml")])
    assert r.exit_code == 0 and "vocab 32000 (assumed)" in r.output
    assert "takes its tokenizer's vocabulary" in r.output
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/llama2-7b-sft-8gpu.yaml")])
    assert "(assumed)" not in r.output


def test_validate_ok_prints_summary(repo_root):
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/llama2-7b-sft-8gpu.yaml")])
    assert r.exit_code == 0, r.output
    assert "world size 8 = data 4 x tensor 2 x pipeline 1" in r.output
    assert "accumulation 8" in r.output and "6,738,415,616 parameters" in r.output


def test_validate_json(repo_root):
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/quickstart.yaml"), "--json"])
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert data["world_size"] == 1 and data["parameters"] > 0


def test_validate_with_set(repo_root):
    r = runner.invoke(
        app,
        ["validate-config", str(repo_root / "configs/quickstart.yaml"), "--set", "parallel.data_parallel=2"],
    )
    assert r.exit_code == 0 and "world size 2" in r.output


def test_schema_is_json():
    r = runner.invoke(app, ["schema"])
    schema = json.loads(r.stdout)
    assert "model_config" in schema["properties"] and "parallel_config" in schema["properties"]


def test_subprocess_bad_config_exit2_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  data_parallel: 4\n  tensor_paralel: 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "validate-config", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"{bad}:3:3" in proc.stderr and "did you mean tensor_parallel?" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_subprocess_unsafe_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_config: !!python/object/new:os.system [echo hi]\n")
    proc = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "validate-config", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unsafe" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_accepts_config_option(repo_root):
    path = str(repo_root / "configs/quickstart.yaml")
    r = runner.invoke(app, ["validate-config", "--config", path])
    assert r.exit_code == 0 and "OK" in r.output
    r = runner.invoke(app, ["validate-config"])
    assert r.exit_code == 2 and "no config given" in r.output
