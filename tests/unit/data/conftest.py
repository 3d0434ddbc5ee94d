"""Fixtures of the data tests: a tiny trained sentencepiece tokenizer and JSONL writers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory) -> tuple:
    d = tmp_path_factory.mktemp("demo")
    return write_demo_data(str(d))


@pytest.fixture(scope="session")
def sp_tok(tmp_path_factory, demo_files):
    d = tmp_path_factory.mktemp("tok")
    return train_demo_tokenizer(str(d), [demo_files[0]])


@pytest.fixture
def write_jsonl(tmp_path):
    def _write(records, name: str = "data.jsonl") -> str:
        p = Path(tmp_path) / name
        with p.open("w", encoding="utf-8") as f:
            for r in records:
                f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
        return str(p)

    return _write


def make_config(tmp_path, **train):
    from bmtrain_cli.config.schema import Config

    max_seq_len = train.pop("max_seq_len", 64)
    train.setdefault("output_dir", str(Path(tmp_path) / "out"))
    train.setdefault("data_cache_dir", str(Path(tmp_path) / "cache"))
    return Config.model_validate({"model_config": {"max_seq_len": max_seq_len}, "train_config": train})
