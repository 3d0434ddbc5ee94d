"""Fixtures of the preference tests: the reverse demo's tokenizer, JSONL writers, a tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data


@pytest.fixture(scope="session")
def letters_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref-demo")
    train, _ = write_demo_data(str(d), task="reverse")
    return train_demo_tokenizer(str(d / "tok"), [train])


@pytest.fixture
def write_jsonl(tmp_path):
    def _write(records, name: str = "pairs.jsonl") -> str:
        p = Path(tmp_path) / name
        with p.open("w", encoding="utf-8") as f:
            for r in records:
                f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
        return str(p)

    return _write


def make_config(tmp_path, model: dict | None = None, **train):
    from bmtrain_cli.config.schema import Config

    train.setdefault("output_dir", str(Path(tmp_path) / "out"))
    train.setdefault("data_cache_dir", str(Path(tmp_path) / "cache"))
    train.setdefault("stage", "dpo")
    model = {"max_seq_len": 32, "model_name_or_path": "unused", **(model or {})}
    return Config.model_validate({"model_config": model, "train_config": train})


def tiny_model(vocab_size: int, seed: int = 0):
    import paddle

    from bmtrain_cli.models import build
    from tests.tiny import ARCH

    paddle.seed(seed)
    return build(dataclasses.replace(ARCH, vocab_size=vocab_size), kernels="reference")
