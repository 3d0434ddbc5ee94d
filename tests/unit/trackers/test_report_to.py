"""train_config.report_to: the names, `none`, and a missing package refused by validate-config."""

from __future__ import annotations

import importlib.util

from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.trackers import BACKENDS, REPORT_TO_NAMES, flatten

runner = CliRunner()


def _cfg(tmp_path, report_to: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(
        "model_config:\n  family: llama\n  hidden_size: 64\n  intermediate_size: 128\n"
        "  num_hidden_layers: 2\n  num_attention_heads: 4\n  max_seq_len: 32\n"
        f"train_config:\n  demo_data: arithmetic\n  report_to: {report_to}\n",
        encoding="utf-8",
    )
    return str(p)


def test_names_come_from_the_registry():
    assert set(REPORT_TO_NAMES) == {"tensorboard", "visualdl", "wandb", "swanlab", "mlflow", "none"}
    assert {b.extra for b in BACKENDS.values()} == {None, "visualdl", "wandb", "swanlab", "mlflow"}


def test_a_name_a_list_and_none_validate(tmp_path):
    for value in ("wandb", "[tensorboard, mlflow]", "none", "[]"):
        r = runner.invoke(app, ["validate-config", _cfg(tmp_path, value)])
        assert r.exit_code == 0, (value, r.output)


def test_unknown_name_and_none_with_others_are_refused(tmp_path):
    r = runner.invoke(app, ["validate-config", _cfg(tmp_path, "[comet]")])
    assert r.exit_code == 2 and "report_to" in r.output and "c.yaml:10" in r.output, r.output
    r = runner.invoke(app, ["validate-config", _cfg(tmp_path, "[none, wandb]")])
    assert r.exit_code == 2 and "none reports to no tracker" in r.output, r.output


def test_missing_package_names_the_extra(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "swanlab" else real(n, *a))
    r = runner.invoke(app, ["validate-config", _cfg(tmp_path, "[tensorboard, swanlab]")])
    assert r.exit_code == 2, r.output
    assert "swanlab package" in r.output and "bmtrain-cli[swanlab]" in r.output, r.output
    assert "Traceback" not in r.output


def test_flatten_dotted_keys():
    flat = flatten({"train_config": {"learning_rate": 1e-3, "data_path": ["a", "b"], "x": None}})
    assert flat == {
        "train_config.learning_rate": 1e-3,
        "train_config.data_path": "['a', 'b']",
        "train_config.x": None,
    }
