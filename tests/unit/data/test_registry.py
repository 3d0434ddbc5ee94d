"""LLaMA-Factory's dataset_info.json registry: names -> data files in this tool's formats."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bmtrain_cli.config.load import load_config
from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.formats import parse_record
from bmtrain_cli.data.readers import read_records
from bmtrain_cli.data.tokenizers import load_tokenizer
from bmtrain_cli.errors import UserError

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture
def lf_dir(tmp_path):
    spec = importlib.util.spec_from_file_location("make_lf", FIXTURES / "make_llamafactory_demo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.write(tmp_path / "data")


def _config(tmp_path, lf_dir, **train):
    p = tmp_path / "c.yaml"
    lines = [f"  {k}: {v}" for k, v in {"dataset_dir": str(lf_dir), **train}.items()]
    p.write_text("model_config:\n  max_seq_len: 256\ntrain_config:\n" + "\n".join(lines) + "\n")
    return load_config(str(p)).config


def test_names_become_data_files(tmp_path, lf_dir):
    cfg = _config(tmp_path, lf_dir, dataset="alpaca_en_demo,glaive_toolcall_en_demo, alpaca_zh_demo")
    paths = cfg.train.data_path
    assert len(paths) == 3 and all(".bmtrain_registry" in p for p in paths)
    tok = load_tokenizer(str(FIXTURES / "chat_parity" / "qwen3"))
    enc = make_encoder(tok, "auto")
    convs = [parse_record(r.value) for p in paths for r in read_records(p)]
    assert len(convs) == 24
    assert convs[0].messages[0] == ("user", "Add 0 and 1.\nShow the sum.")
    glaive = convs[8]
    assert [r for r, _ in glaive.messages] == ["user", "assistant", "tool", "assistant"]
    ids, mask = enc.encode(glaive)
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "calculate_bmi", "arguments": {"weight": 60, "height": 1.75}}' in trained
    assert "calculate_bmi" in tok.decode(ids)  # the tools block of the system prompt
    again = _config(tmp_path, lf_dir, dataset="alpaca_en_demo")
    assert again.train.data_path == [paths[0]]  # reused, not rewritten


def test_ranking_entry_gives_pairs(tmp_path, lf_dir):
    cfg = _config(tmp_path, lf_dir, dataset="dpo_en_demo")
    rec = next(iter(read_records(cfg.train.data_path[0]))).value
    assert rec["chosen"] == "0 rebmun drow" and rec["rejected"] == "I cannot."
    assert rec["messages"] == [{"role": "user", "content": "Reverse the word number 0."}]


@pytest.mark.parametrize(
    "name, match",
    [
        ("alpaca_en", "dataset 'alpaca_en' is fetched from the network \\(hf_hub_url"),
        ("alpaca_en_dem", "did you mean"),
    ],
)
def test_refused_entries_named(tmp_path, lf_dir, name, match):
    with pytest.raises(UserError, match=match):
        _config(tmp_path, lf_dir, dataset=name)


@pytest.mark.parametrize("stage, name", [("sft", "glaive_toolcall_en_demo"), ("dpo", "dpo_en_demo")])
def test_data_preview_marks_trained_tokens(tmp_path, lf_dir, stage, name):
    from bmtrain_cli.commands.data_preview import mark, preview
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.data.registry import materialize

    train = {"data_path": materialize(name, str(lf_dir)), "stage": stage}
    cfg = Config.model_validate({"model_config": {"max_seq_len": 256}, "train_config": train})
    tok = load_tokenizer(str(FIXTURES / "chat_parity" / "qwen3"))
    lines = preview(cfg, tok, 2, colour=False)
    assert sum(line.startswith("--- ") for line in lines) == 2
    text = "\n".join(lines)
    if stage == "dpo":
        assert (
            "[chosen]" in text and "0 rebmun drow<|im_end|>\n]]" in text and "I cannot.<|im_end|>\n]]" in text
        )
    else:
        assert (
            '[[<tool_call>\n{"name": "calculate_bmi"' in text
            and "[[<think>\n\n</think>\n\nYour BMI is" in text
        )
    assert "\x1b[32mb\x1b[0m" in mark(
        tok, tok.encode("ab"), [False] * (len(tok.encode("ab")) - 1) + [True], True
    )
