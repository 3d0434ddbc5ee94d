"""One recipe per method, end to end on the tiny model: train_config.stage picks recipes/sft.py or
recipes/dpo.py; a user's copy named by train_config.recipe or `--recipe` (or run as a script) is the one
that runs; validate-config checks a named recipe file without running it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.preference.demo import preference_records
from tests.tiny import model_yaml

REPO = Path(__file__).resolve().parents[2]
MARKER = "my recipe ran"

SFT = (
    model_yaml(max_seq_len=24, kv_heads=None, vocab_size=512)
    + """
train_config:
  demo_data: reverse
  output_dir: {out}
  max_steps: 2
  micro_batch_size: 8
  learning_rate: 3.0e-3
  warmup_steps: 0
  logging_steps: 1
  save_steps: 2
  num_workers: 0
{extra}
"""
)

DPO = """
model_config:
  model_name_or_path: {base}
  max_seq_len: 32
  kernels: reference
train_config:
  stage: dpo
  dpo_loss: sigmoid
  dpo_beta: 0.5
  data_path: {data}/train.jsonl
  eval_data_path: {data}/eval.jsonl
  output_dir: {out}
  max_steps: 2
  micro_batch_size: 4
  learning_rate: 5.0e-3
  logging_steps: 1
  save_steps: 2
{extra}
"""


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def _marked_copy(src: Path, dst: Path) -> Path:
    """A copy of a built-in recipe, edited as a user would: it says so and leaves a file behind."""
    text = src.read_text(encoding="utf-8")
    anchor = "    parts, state = setup(loaded, stream=stream)\n"
    assert text.count(anchor) == 1
    mark = (
        f'    parts.console.say("{MARKER}")\n'
        f'    (parts.runtime.output_dir / "marker").write_text("{dst.name}")\n'
    )
    dst.write_text(text.replace(anchor, anchor + mark), encoding="utf-8")
    return dst


def _train(*args: str):
    return CliRunner().invoke(app, ["train", *args], catch_exceptions=False)


def _validate(cfg: str):
    return CliRunner().invoke(app, ["validate-config", cfg])


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    """An SFT checkpoint of the tiny model on the reverse task (through recipes/sft.py), and pair files."""
    root = tmp_path_factory.mktemp("recipes")
    res = _train("--config", _write(root / "sft.yaml", SFT.format(out=root / "sft", extra="")))
    assert res.exit_code == 0, res.output
    assert MARKER not in res.output and not (root / "sft" / "marker").exists()
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(24)]
    data = root / "pairs"
    data.mkdir()
    for name, part in (("train", words[:16]), ("eval", words[16:])):
        lines = [json.dumps(r) for r in preference_records(part, rng)]
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root / "sft" / "checkpoints" / "step-2", data


def test_a_recipe_named_in_the_config_is_the_one_that_runs(tmp_path):
    mine = _marked_copy(REPO / "recipes" / "sft.py", tmp_path / "my_sft.py")
    cfg = _write(tmp_path / "c.yaml", SFT.format(out=tmp_path / "out", extra=f"  recipe: {mine}"))
    res = _train("--config", cfg)
    assert res.exit_code == 0, res.output
    assert MARKER in res.output and (tmp_path / "out" / "marker").read_text() == "my_sft.py"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 2


def test_recipe_option_points_bmtrain_train_at_a_file(tmp_path):
    mine = _marked_copy(REPO / "recipes" / "sft.py", tmp_path / "other.py")
    cfg = _write(tmp_path / "c.yaml", SFT.format(out=tmp_path / "out", extra=""))
    res = _train("--config", cfg, "--recipe", str(mine))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "marker").read_text() == "other.py"
    saved = (tmp_path / "out" / "config.yaml").read_text()
    assert f"recipe: {mine}" in saved  # the resolved config says which recipe trained it


def test_a_copied_recipe_runs_as_a_script(tmp_path):
    mine = _marked_copy(REPO / "recipes" / "sft.py", tmp_path / "script.py")
    cfg = _write(tmp_path / "c.yaml", SFT.format(out=tmp_path / "out", extra=""))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, str(mine), "--config", cfg, "--set", "train_config.max_steps=1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert MARKER in res.stdout and (tmp_path / "out" / "marker").read_text() == "script.py"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 1


def test_stage_dpo_runs_the_preference_recipe(tmp_path, sft_base):
    base, data = sft_base
    cfg = _write(tmp_path / "d.yaml", DPO.format(base=base, data=data, out=tmp_path / "out", extra=""))
    res = _train("--config", cfg)
    assert res.exit_code == 0, res.output
    assert "reference model: a frozen copy of" in res.output
    assert "held-out preference accuracy before training:" in res.output
    assert "held-out preference accuracy: before" in res.output
    out = tmp_path / "out"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "loss" in r and "event" not in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert len(train) == 2 and all("rewards/margins" in r for r in train)
    assert evals and "eval_ppl" not in evals[-1] and "rewards/accuracies" in evals[-1]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("rewards/chosen", "eval_preference_accuracy", "before_eval_preference_accuracy"):
        assert key in summary, key


def test_a_copied_dpo_recipe_runs_under_bmtrain_train(tmp_path, sft_base):
    base, data = sft_base
    mine = _marked_copy(REPO / "recipes" / "dpo.py", tmp_path / "my_dpo.py")
    cfg = _write(tmp_path / "d.yaml", DPO.format(base=base, data=data, out=tmp_path / "out", extra=""))
    res = _train("--config", cfg, "--recipe", str(mine), "--set", "train_config.dpo_loss=orpo")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "out" / "marker").read_text() == "my_dpo.py"
    assert "eval_preference_accuracy" in json.loads((tmp_path / "out" / "summary.json").read_text())


def test_bmtrain_run_launches_the_stage_recipe_or_the_named_one(tmp_path, sft_base):
    base, data = sft_base
    cfg = _write(
        tmp_path / "d.yaml",
        DPO.format(base=base, data=data, out=tmp_path / "out", extra="")
        + "parallel_config:\n  data_parallel: 2\n",
    )
    res = CliRunner().invoke(app, ["run", "--config", cfg, "--dry_run"])
    assert res.exit_code == 0, res.output
    assert f"{REPO / 'recipes' / 'dpo.py'} --config {cfg}" in res.output
    mine = _marked_copy(REPO / "recipes" / "dpo.py", tmp_path / "mine.py")
    res = CliRunner().invoke(app, ["run", "--config", cfg, "--dry_run", "--recipe", str(mine)])
    assert res.exit_code == 0, res.output
    assert f"{mine} --config {cfg} --recipe {mine}" in res.output


@pytest.mark.parametrize(
    "body,expected",
    [
        (None, "no such file"),
        ("", "'' is not a Python file (.py)"),
        ("def other(loaded):\n    pass\n", "defines no top-level recipe(loaded, stream=None, on_step=None)"),
        ("def recipe(loaded):\n    pass\n", "mine.py:1: recipe() cannot be called as"),
        ("x = 1\n\ndef recipe(loaded, stream=None, on_step=None)\n", "mine.py:3: the recipe does not parse"),
    ],
    ids=["missing", "empty", "no-recipe", "signature", "syntax"],
)
def test_validate_config_checks_a_named_recipe_with_file_and_line(tmp_path, body, expected):
    mine = tmp_path / "mine.py"
    if body:
        mine.write_text(body)
    named = "''" if body == "" else mine  # "": an empty name
    cfg = _write(tmp_path / "c.yaml", SFT.format(out=tmp_path / "out", extra=f"  recipe: {named}"))
    res = _validate(cfg)
    assert res.exit_code == 2, res.output
    line = SFT.format(out="", extra="").splitlines().index("  num_workers: 0") + 2  # the recipe: line
    assert f"{cfg}:{line}" in res.output and "train_config.recipe" in res.output
    assert expected in res.output


def test_validate_config_does_not_run_the_recipe(tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text('raise SystemExit("user code ran")\n\n\ndef recipe(loaded, **kw):\n    pass\n')
    cfg = _write(tmp_path / "c.yaml", SFT.format(out=tmp_path / "out", extra=f"  recipe: {mine}"))
    res = _validate(cfg)
    assert res.exit_code == 0 and "user code ran" not in res.output, res.output


def test_a_built_in_recipe_of_another_stage_is_refused(tmp_path):
    cfg = _write(
        tmp_path / "c.yaml",
        SFT.format(out=tmp_path / "out", extra=f"  recipe: {REPO / 'recipes' / 'dpo.py'}"),
    )
    res = _validate(cfg)
    assert res.exit_code == 2 and "is the built-in recipe of stage dpo" in res.output, res.output
