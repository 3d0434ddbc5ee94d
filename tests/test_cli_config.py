"""CLI: validate-config and schema through Typer's runner and as real subprocesses."""

from __future__ import annotations

import json
import subprocess
import sys

import typer
import yaml
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


def test_fresh_model_vocab_is_said_to_be_assumed(repo_root, tmp_path, write_yaml):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "a", "output": "b"}\n')
    cfg = write_yaml(f"model_config:\n  hidden_size: 64\ntrain_config:\n  data_path: {data}\n")
    r = runner.invoke(app, ["validate-config", cfg])
    assert r.exit_code == 0 and "vocab 32000 (assumed)" in r.output
    assert "takes its tokenizer's vocabulary" in r.output
    # the demo task's tokenizer is known before training: the real vocabulary and parameter count
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/quickstart.yaml")])
    assert r.exit_code == 0 and "(assumed)" not in r.output
    assert "vocab 360 (the demo task's tokenizer), 441,984 parameters" in r.output
    r = runner.invoke(app, ["validate-config", str(repo_root / "configs/quickstart.yaml"), "--json"])
    assert json.loads(r.stdout)["parameters"] == 441_984
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


def _schema_refuses(schema, data):
    """What an editor's JSON Schema check of a config's keys would refuse (two levels: sections, keys)."""
    problems = [k for k in data if k not in schema["properties"]]
    if all(k in data for k in schema["not"]["required"]):
        problems.append("both " + " and ".join(schema["not"]["required"]))
    for section, body in data.items():
        ref = schema["properties"].get(section, {}).get("$ref", "")
        allowed = schema["$defs"][ref.rsplit("/", 1)[-1]]["properties"] if ref else {}
        problems += [f"{section}.{k}" for k in (body or {}) if k not in allowed]
    return problems


def test_schema_accepts_the_parallel_synonym(repo_root):
    schema = json.loads(runner.invoke(app, ["schema"]).stdout)
    assert schema["additionalProperties"] is False
    for path in sorted((repo_root / "configs").glob("*.yaml")):
        assert _schema_refuses(schema, yaml.safe_load(path.read_text())) == [], path.name
    readme = (repo_root / "README.md").read_text()
    example = yaml.safe_load(readme.split("```yaml\n")[1].split("```")[0])
    assert "parallel" in example and _schema_refuses(schema, example) == []
    assert _schema_refuses(schema, {"parallel": {}, "parallel_config": {}}) == [
        "both parallel and parallel_config"
    ]
    assert _schema_refuses(schema, {"parallel": {"tensor_paralel": 2}}) == ["parallel.tensor_paralel"]


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


def test_help_at_80_columns_shows_whole_option_names():
    """Every command's --help in an 80-column terminal names each option in full (no "--model_path,--mode…")
    and gives every option a help text."""
    import os

    import click

    env = dict(os.environ, COLUMNS="80")
    for command in app.registered_commands:
        name = command.name or command.callback.__name__.replace("_", "-")
        out = subprocess.run(
            [sys.executable, "-m", "bmtrain_cli", name, "--help"], capture_output=True, text=True, env=env
        ).stdout
        assert "…" not in out and max(map(len, out.splitlines())) <= 80, (name, out)
        params = typer.main.get_command(app).commands[name].params
        for p in params:
            if isinstance(p, click.Option):
                assert all(opt in out for opt in p.opts), (name, p.opts)
                if name in ("generate", "eval"):
                    assert p.help, (name, p.opts)
