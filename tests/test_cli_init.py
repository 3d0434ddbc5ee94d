"""`bmtrain init` and `--config NAME`: the example configs reach a user who has only the installed package."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.config import load_config
from bmtrain_cli.config.examples import examples
from bmtrain_cli.errors import ConfigError

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_config_is_an_example():
    assert set(examples()) == {p.stem for p in (REPO / "configs").glob("*.yaml")}


def test_init_lists_then_writes_a_config_that_validates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["init"])
    assert r.exit_code == 0 and "quickstart" in r.output and "llama-tiny-lora" in r.output
    r = runner.invoke(app, ["init", "quickstart"])
    assert r.exit_code == 0, r.output
    written = tmp_path / "quickstart.yaml"
    shipped = (REPO / "configs/quickstart.yaml").read_text()
    assert written.read_text() == shipped.replace("configs/quickstart.yaml", "quickstart.yaml")
    assert "# Run:  bmtrain train --config quickstart.yaml" in written.read_text()
    assert "bmtrain train --config quickstart.yaml" in r.output
    assert runner.invoke(app, ["validate-config", "quickstart.yaml"]).exit_code == 0
    # never overwritten without --force
    written.write_text("# mine\n")
    r = runner.invoke(app, ["init", "quickstart"])
    assert r.exit_code == 2 and "--force" in r.output and written.read_text() == "# mine\n"
    r = runner.invoke(app, ["init", "quickstart", "--output", str(tmp_path / "sub.yaml")])
    assert r.exit_code == 0 and (tmp_path / "sub.yaml").is_file()
    r = runner.invoke(app, ["init", "nope"])
    assert r.exit_code == 2 and "quickstart" in r.output


def test_config_name_resolves_to_the_packaged_example(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty directory: no configs/ here
    loaded = load_config("quickstart")
    assert loaded.config.train.demo_data == "reverse"
    assert Path(loaded.source).name == "quickstart.yaml"
    r = runner.invoke(app, ["validate-config", "--config", "quickstart"])
    assert r.exit_code == 0, r.output
    with pytest.raises(ConfigError, match="bmtrain init"):
        load_config("no-such-config.yaml")


def test_empty_config_points_at_init(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(empty))
    assert "bmtrain init quickstart" in info.value.problems[0].format()
