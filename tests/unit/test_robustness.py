"""Broken inputs generated systematically, not by hand (issue 18). Each must end in exit 0, or exit 2 with
one line per problem; never a traceback, and never a change to files the command should not touch.

- every field of the config schema, mutated (wrong type, sign, zero, huge, inf/nan, an unknown neighbour),
  through `bmtrain validate-config`;
- data records (surrogates, control characters, nesting, sizes, wrong types, bad bytes) through the one
  reader and the dataset builder every command uses;
- every file of a checkpoint (truncated at several offsets, garbage, pickle bytes, missing) through
  `bmtrain train --resume`, hashing the run directory before and after.

docs/training.md ("Guarantees") states what these check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple, get_args

import pytest
import yaml
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.config.schema import SECTION_MODELS
from tests.robustness import FILE_MUTATIONS, assert_clean_exit, run_config
from tests.tiny import model_dict, model_yaml
from tests.tree import tree_digest

MISSING = object()  # "remove the key" / "remove the file"

# ----------------------------------------------------------------------------- config fields

BASE: Dict[str, Dict[str, Any]] = {
    "model_config": model_dict(),
    "train_config": {"data_path": "train.jsonl", "max_steps": 4},
    "parallel_config": {},
}

HUGE = 10**30
FIELD_MUTATIONS: List[Tuple[str, Any]] = [
    ("string", "abc"),
    ("empty string", ""),
    ("list", [1, 2]),
    ("mapping", {"a": 1}),
    ("boolean", True),
    ("null", None),
    ("negative", -1),
    ("zero", 0),
    ("fraction", 0.5),
    ("huge", HUGE),
    ("-huge", -HUGE),
    ("inf", float("inf")),
    ("-inf", float("-inf")),
    ("nan", float("nan")),
    ("removed", MISSING),
]

FIELDS = [(section, name) for section, model in SECTION_MODELS.items() for name in model.model_fields]


def _validate(tmp_path: Path, data: Dict[str, Any]) -> Any:
    path = tmp_path / "mutated.yaml"
    if data.get("train_config", {}).get("data_path") == "train.jsonl":  # validate-config wants it to exist
        (tmp_path / "train.jsonl").write_text('{"input": "a", "output": "b"}\n', encoding="utf-8")
        data = {**data, "train_config": {**data["train_config"], "data_path": str(tmp_path / "train.jsonl")}}
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return CliRunner().invoke(app, ["validate-config", str(path)])


def test_the_base_config_is_valid(tmp_path):
    res = _validate(tmp_path, BASE)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("section, name", FIELDS, ids=[f"{s}.{n}" for s, n in FIELDS])
def test_every_field_mutation_is_refused_cleanly_or_accepted(tmp_path, section, name):
    for label, value in FIELD_MUTATIONS:
        data = json.loads(json.dumps(BASE))
        if value is MISSING:
            data[section].pop(name, None)
        else:
            data[section][name] = value
        assert_clean_exit(_validate(tmp_path, data), f"{section}.{name} = {label}")
    # an unknown key next to it (a typo) is refused and the right name suggested
    data = json.loads(json.dumps(BASE))
    data[section][name + "x"] = 1
    res = _validate(tmp_path, data)
    assert res.exit_code == 2 and f"unknown key '{name}x'" in res.output, res.output
    assert f"did you mean {name}?" in res.output


def _takes_float(tp: Any) -> bool:
    return tp is float or any(_takes_float(a) for a in get_args(tp))


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_no_float_field_takes_a_non_finite_value(tmp_path, value):
    """learning_rate .inf used to train and write non-finite weights with exit 0."""
    floats = [
        (s, n)
        for s, model in SECTION_MODELS.items()
        for n, f in model.model_fields.items()
        if _takes_float(f.annotation)
    ]
    assert ("train_config", "learning_rate") in floats and ("train_config", "adam_beta2") in floats
    for section, name in floats:
        data = json.loads(json.dumps(BASE))
        data[section][name] = [1.0, value] if name == "data_weights" else value
        if name == "data_weights":
            data["train_config"]["data_path"] = ["a.jsonl", "b.jsonl"]
        res = _validate(tmp_path, data)
        assert res.exit_code == 2 and "finite number" in res.output, f"{section}.{name}={value}: {res.output}"


# ----------------------------------------------------------------------------- data records

GOOD = '{"input": "12+3=", "output": "15"}'
RECORDS: List[Tuple[str, bytes]] = [
    ("lone high surrogate", b'{"input": "\\ud800=", "output": "x"}'),
    ("lone low surrogate", b'{"input": "a", "output": "\\udc00"}'),
    ("reversed surrogate pair", b'{"input": "\\ude00\\ud83d", "output": "x"}'),
    ("surrogate in a key", b'{"\\ud800": "a", "input": "b", "output": "x"}'),
    ("escaped control characters", b'{"input": "a\\u0000b\\u001b[31m", "output": "\\u0007"}'),
    ("raw control character", b'{"input": "a\x01b", "output": "x"}'),
    ("line separator", '{"input": "a\u2028b", "output": "x"}'.encode()),
    ("NUL byte", b'{"input": "a", "output": "x"}\x00'),
    ("invalid UTF-8", b'{"input": "\xff\xfe", "output": "x"}'),
    ("BOM mid-file", b'\xef\xbb\xbf{"input": "a", "output": "x"}'),
    ("deep nesting", b'{"input": ' + b"[" * 100_000 + b"]" * 100_000 + b', "output": "x"}'),
    ("deep nesting in a string field", b'{"input": {"a": ' * 500 + b"1" + b"}" * 500 + b', "output": "x"}'),
    ("huge string", b'{"input": "' + b"7" * 2_000_000 + b'", "output": "x"}'),
    ("number instead of text", b'{"input": 123, "output": "x"}'),
    ("null output", b'{"input": "a", "output": null}'),
    ("list input", b'{"input": ["a", "b"], "output": "x"}'),
    ("boolean output", b'{"input": "a", "output": true}'),
    ("NaN literal", b'{"input": "a", "output": NaN}'),
    ("empty object", b"{}"),
    ("top-level array", b"[1, 2]"),
    ("top-level string", b'"text"'),
    ("top-level number", b"42"),
    ("top-level null", b"null"),
    ("truncated record", b'{"input": "a", "out'),
    ("unknown keys only", b'{"question": "a", "answer": "x"}'),
    ("chat with a bad role", b'{"messages": [{"role": "wizard", "content": "a"}]}'),
    ("chat with non-text content", b'{"messages": [{"role": "user", "content": 5}]}'),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    texts = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)]
    return train_sentencepiece(texts, str(tmp_path_factory.mktemp("tok")), vocab_size=400)


@pytest.mark.parametrize("label, record", RECORDS, ids=[r[0] for r in RECORDS])
def test_every_broken_record_is_named_or_set_aside(tmp_path, tokenizer, label, record):
    """The record on line 2 is used, or refused naming file:2 (on_bad_record: error), or set aside as
    line 2 (skip); a lone surrogate used to crash the tokenizer in train, data-stats, prepare-data, eval."""
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.loader import load_dataset
    from bmtrain_cli.data.readers import read_records
    from bmtrain_cli.errors import UserError

    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + record + b"\n" + GOOD.encode() + b"\n")
    recs = list(read_records(str(path)))
    assert [r.line for r in recs] == [1, 2, 3], label
    encoder = make_encoder(tokenizer, "auto", False)
    try:
        ds = load_dataset([str(path)], encoder, on_bad_record="error", cache_dir=str(tmp_path / "c1"))
        assert len(ds) == 3, label
    except UserError as exc:
        assert str(exc).startswith(f"{path}:2: ") and "\n" not in str(exc), f"{label}: {exc}"
    out = tmp_path / "out"
    ds = load_dataset(
        [str(path)], encoder, on_bad_record="skip", cache_dir=str(tmp_path / "c2"), output_dir=str(out)
    )
    assert [r["line"] for r in ds.rejected()] in ([], [2]), label
    assert len(ds) + ds.rejected_count == 3
    if ds.rejected_count:
        rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text(encoding="utf-8").splitlines()]
        assert [r["line"] for r in rejected] == [2]


def test_a_lone_surrogate_is_a_bad_record_in_every_command(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + '\n{"input": "\\ud800=", "output": "x"}\n', encoding="utf-8")
    tokenizer.save(str(tmp_path / "tok"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        model_yaml(tokenizer_path=str(tmp_path / "tok"))
        + f"train_config:\n  data_path: {path}\n  output_dir: {tmp_path / 'out'}\n  max_steps: 1\n",
        encoding="utf-8",
    )
    for command in (["data-stats", "--config", str(cfg)], ["prepare-data", "--config", str(cfg)]):
        res = CliRunner().invoke(app, command)
        assert res.exit_code == 2 and f"{path}:2: invalid text: lone UTF-16 surrogate \\ud800" in res.output


# ----------------------------------------------------------------------------- checkpoint files

CHECKPOINT_FILES = ["model.safetensors", "optimizer.safetensors", "trainer_state.json", "config.json"]
FAST = {"truncated at half", "garbage"}  # the rest of the matrix runs with -m slow

CASES = [
    pytest.param(f, m, marks=() if m in FAST else pytest.mark.slow, id=f"{f}-{m}")
    for f in CHECKPOINT_FILES
    for m in FILE_MUTATIONS
]


@pytest.mark.parametrize("name, mutation", CASES)
def test_a_damaged_checkpoint_file_is_named_and_nothing_changes(robust_run, tmp_path, name, mutation):
    """A truncated optimizer.safetensors gave a SafetensorError traceback. Resuming from a damaged
    checkpoint exits 2 naming the file (or resumes when the damage is harmless), and a refused resume
    changes no file of the run directory."""
    src, out0, data = robust_run
    out = tmp_path / "out"
    shutil.copytree(out0, out)
    FILE_MUTATIONS[mutation](out / "checkpoints" / "step-2" / name)
    before = tree_digest(out)
    cfg = run_config(tmp_path, out, data, 3)
    res = CliRunner().invoke(app, ["train", "--config", cfg, "--resume"])
    assert_clean_exit(res, f"{name} {mutation}")
    assert res.exit_code == 2, f"{name} {mutation}: a damaged checkpoint was resumed\n{res.output}"
    assert name in res.output or "step-2" in res.output, res.output
    assert tree_digest(out) == before


def test_an_intact_checkpoint_resumes(robust_run, tmp_path):
    """The control of the test above: the same copy, undamaged, resumes to step 3."""
    _, out0, data = robust_run
    out = tmp_path / "out"
    shutil.copytree(out0, out)
    res = CliRunner().invoke(app, ["train", "--config", run_config(tmp_path, out, data, 3), "--resume"])
    assert res.exit_code == 0, res.output
    assert "resumed from step-2" in res.output and (out / "checkpoints" / "step-3").is_dir()
