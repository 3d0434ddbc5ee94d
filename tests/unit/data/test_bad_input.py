"""Bad input: one-line UserError naming file:line and the reason, or skipped and written to rejected.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bmtrain_cli.data.loader import build_loader
from bmtrain_cli.errors import UserError

from .conftest import make_config

GOOD = {"input": "1+2=", "output": "3"}


def _write_bytes(tmp_path, lines, name="bad.jsonl"):
    p = Path(tmp_path) / name
    p.write_bytes(b"".join(lines))
    return str(p)


CASES = [
    ([json.dumps(GOOD).encode() + b"\n", b'{"input": "1+2=", "output": \n'], 2, "invalid JSON"),
    ([json.dumps(GOOD).encode() + b"\n", b'{"input": "1+2="}\n'], 2, 'missing field "output"'),
    ([b'{"input": "1", "output": 5}\n'], 1, 'field "output" must be a string'),
    ([json.dumps(GOOD).encode() + b"\n\n", b'{"input": "a", "output": ""}\n'], 3, 'field "output" is empty'),
    ([json.dumps(GOOD).encode() + b"\n", b'{"input": "\xff\xfe", "output": "3"}\n'], 2, "invalid UTF-8"),
    ([], 1, "file is empty"),
]


@pytest.mark.parametrize("lines,line,reason", CASES)
def test_bad_input_raises_file_line_reason(tmp_path, sp_tok, lines, line, reason):
    path = _write_bytes(tmp_path, lines)
    cfg = make_config(tmp_path, data_path=path)
    with pytest.raises(UserError) as exc:
        build_loader(cfg, sp_tok)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:{line}: ") and reason in msg
    assert "\n" not in msg


def test_missing_file(tmp_path, sp_tok):
    cfg = make_config(tmp_path, data_path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="nope.jsonl: data file not found"):
        build_loader(cfg, sp_tok)


def test_error_counts_further_bad_records(tmp_path, sp_tok, write_jsonl):
    path = write_jsonl([GOOD, "{oops", GOOD, {"input": "x"}, "[1"])
    with pytest.raises(UserError, match=r":2: invalid JSON.*\(2 more bad records"):
        build_loader(make_config(tmp_path, data_path=path), sp_tok)


def test_skip_writes_rejected_with_reasons(tmp_path, sp_tok, write_jsonl):
    path = write_jsonl([GOOD, "{oops", GOOD, {"input": "x"}, {"input": "2+2=", "output": "4"}])
    cfg = make_config(tmp_path, data_path=path, on_bad_record="skip", micro_batch_size=2, shuffle=False)
    loader = build_loader(cfg, sp_tok)
    st = loader.stats()
    assert st["records"] == 5 and st["rejected"] == 2 and st["samples"] == 3
    rejected = [
        json.loads(x) for x in (Path(cfg.train.output_dir) / "rejected.jsonl").read_text().splitlines()
    ]
    assert [(r["line"], r["reason"].split(":")[0]) for r in rejected] == [
        (2, "invalid JSON"),
        (4, 'missing field "output"'),
    ]
    assert rejected[0]["record"] == "{oops" and rejected[0]["file"] == path
    seen = sum(int((b["labels"] != -100).any(axis=1).sum()) for b, _ in zip(loader, range(len(loader))))
    assert seen == 3


def test_json_array_file_line_numbers(tmp_path, sp_tok):
    p = Path(tmp_path) / "alpaca.json"
    p.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "c",\n   "output": ""}\n]\n')
    with pytest.raises(UserError, match=r"alpaca.json:3: field \"output\" is empty"):
        build_loader(make_config(tmp_path, data_path=str(p)), sp_tok)


def test_cli_data_stats_exit_2_on_bad_record(tmp_path, sp_tok, write_jsonl, write_yaml):
    from typer.testing import CliRunner

    from bmtrain_cli.cli import app

    sp_tok.save(str(tmp_path / "tok"))
    path = write_jsonl([GOOD, {"input": "1", "output": ""}])
    cfg = write_yaml(
        f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n  max_seq_len: 32\n"
        f"train_config:\n  data_path: {path}\n  output_dir: {tmp_path / 'o'}\n"
    )
    res = CliRunner().invoke(app, ["data-stats", "--config", cfg])
    assert res.exit_code == 2
    assert f'{path}:2: field "output" is empty' in res.output
    assert "Traceback" not in res.output


def test_invalid_json_names_the_column_where_the_line_breaks_off(tmp_path, sp_tok):
    # an unterminated object: the error is at the end of the line, not "column 1" of the next one
    line = b'{"input": "1+2=", "output": "3"'
    path = _write_bytes(tmp_path, [json.dumps(GOOD).encode() + b"\n", line + b"\r\n"])
    with pytest.raises(
        UserError, match=rf":2: invalid JSON: Expecting ',' delimiter \(column {len(line) + 1}\)"
    ):
        build_loader(make_config(tmp_path, data_path=path), sp_tok)
