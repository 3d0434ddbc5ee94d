"""data-stats and prepare-data on a demo config read the generated task (as `bmtrain train` would);
validate-config refuses a data_path that names no file, with its file:line."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from bmtrain_cli.cli import app

runner = CliRunner()


def test_data_stats_and_prepare_data_on_the_quickstart(tmp_path, monkeypatch, repo_root):
    monkeypatch.chdir(tmp_path)
    cfg = str(repo_root / "configs/quickstart.yaml")
    r = runner.invoke(app, ["data-stats", "--config", cfg, "--json", "--sample", "200"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout[r.stdout.index("{") :])
    assert 150 < stats["sample"]["records"] <= 200 and stats["tokens"] > 0  # a random sample of ~200
    r = runner.invoke(app, ["prepare-data", "--config", cfg])
    assert r.exit_code == 0, r.output
    assert "train: 20000 records, 20000 usable, 0 rejected" in r.output
    assert "bmtrain train` generates the same under output/quickstart/data" in r.output
    assert not (tmp_path / "output").exists()  # nothing written into the run's output_dir


def test_validate_config_refuses_missing_data_with_its_line(tmp_path, write_yaml):
    present = tmp_path / "train.jsonl"
    present.write_text('{"input": "a", "output": "b"}\n')
    cfg = write_yaml(
        "model_config:\n  hidden_size: 64\n"
        f"train_config:\n  data_path: [{present}, {tmp_path}/nope.jsonl]\n  eval_data_path: '{tmp_path}/*.none'\n"
    )
    r = runner.invoke(app, ["validate-config", str(cfg)])
    assert r.exit_code == 2
    assert f"{cfg}:4:" in r.output and "nope.jsonl: data file not found" in r.output
    assert f"{cfg}:5:" in r.output and "the pattern matches no file" in r.output
    assert str(present) + ":" not in r.output
    ok = write_yaml(f"model_config:\n  hidden_size: 64\ntrain_config:\n  data_path: {present}\n", "ok.yaml")
    assert runner.invoke(app, ["validate-config", str(ok)]).exit_code == 0
    # the demo task is generated: no data_path to check
    demo = write_yaml("model_config:\n  hidden_size: 64\ntrain_config:\n  demo_data: reverse\n", "demo.yaml")
    assert runner.invoke(app, ["validate-config", str(demo)]).exit_code == 0
