"""What the plan reads from the tokenizer and the data before training (plan/data_facts.py), and how the
estimate uses it: the vocabulary of a tokenizer generated at run time, the longest sample under
``batching: longest``, and the notes that say what was assumed."""

from __future__ import annotations

import json

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.plan.data_facts import data_facts
from bmtrain_cli.plan.estimator import Workload, estimate

pytest.importorskip("paddle")

BASE = """
model_config:
  hidden_size: 64
  intermediate_size: 172
  num_hidden_layers: 2
  num_attention_heads: 4
  max_seq_len: {seq}
train_config:
  output_dir: {out}
  micro_batch_size: 4
  batching: {batching}
{data}
"""


def _config(write_yaml, tmp_path, *, seq=64, batching="longest", data="  demo_data: reverse"):
    return load_config(
        write_yaml(BASE.format(seq=seq, out=tmp_path / "out", batching=batching, data=data))
    ).config


def test_demo_data_gives_the_demo_tokenizer_vocabulary_and_the_longest_sample(write_yaml, tmp_path) -> None:
    config = _config(write_yaml, tmp_path)
    facts = data_facts(config)
    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data
    from bmtrain_cli.data.loader import build_loader

    # what the trainer does: generate the data and the tokenizer, index the data
    train, heldout = write_demo_data(str(tmp_path / "data"), task="reverse", seed=0)
    tok = train_demo_tokenizer(str(tmp_path / "tok"), [train, heldout])
    loader = build_loader(config, tok, split="train", data_path=train, output_dir=str(tmp_path / "o2"))
    assert facts.vocab_size == tok.vocab_size
    assert facts.longest == loader.longest < 64
    assert "longest sample is" in facts.note
    assert not (tmp_path / "out").exists()  # the plan writes nothing to the output directory
    w = Workload.from_config(config)
    assert w.seq_len == facts.longest and w.arch.vocab_size == tok.vocab_size


def test_a_configured_vocab_size_above_the_tokenizers_is_the_one_planned(write_yaml, tmp_path) -> None:
    # what the trainer builds (config/checks.fresh_vocab_size): model_config.vocab_size when set; the plan
    # used the tokenizer's and left the 49152 x 576 embedding of a SmolLM2-shaped config out (-23%)
    text = BASE.format(seq=64, out=tmp_path / "out", batching="max_length", data="  demo_data: reverse")
    tok_vocab = Workload.from_config(load_config(write_yaml(text)).config).arch.vocab_size
    padded = text.replace("model_config:\n", "model_config:\n  vocab_size: 5000\n")
    w = Workload.from_config(load_config(write_yaml(padded)).config)
    assert tok_vocab < 5000 and w.arch.vocab_size == 5000


def test_longest_follows_the_data_and_is_capped_at_max_seq_len(write_yaml, tmp_path) -> None:
    data = tmp_path / "d.jsonl"
    rows = [{"input": "a " * n, "output": "b " * n} for n in (2, 5, 40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    train_sentencepiece(["a b c " * 50], str(tmp_path / "tok"), vocab_size=300)
    text = BASE.format(seq=512, out=tmp_path / "out", batching="longest", data=f"  data_path: {data}")
    text = text.replace("model_config:\n", f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n")
    long_cfg = load_config(write_yaml(text)).config
    short_cfg = load_config(write_yaml(text.replace("max_seq_len: 512", "max_seq_len: 32"))).config
    longest = data_facts(long_cfg).longest
    assert longest is not None and 40 < longest < 512  # the 80-word record, well under 512
    assert data_facts(short_cfg).longest == 32  # truncated to max_seq_len
    # the estimate grows with the longest sample, not with max_seq_len
    assert (
        estimate(long_cfg, "cpu").activations
        < estimate(
            load_config(write_yaml(text.replace("batching: longest", "batching: max_length"))).config, "cpu"
        ).activations
    )


def test_max_length_and_packed_fill_max_seq_len_without_reading_data(write_yaml, tmp_path) -> None:
    for batching in ("max_length", "packed"):
        config = _config(write_yaml, tmp_path, batching=batching)
        assert data_facts(config, need_vocab=False).longest is None
        assert Workload.from_config(config).seq_len == 64


def test_missing_data_is_an_upper_bound_with_a_note(write_yaml, tmp_path) -> None:
    text = BASE.format(
        seq=128, out=tmp_path / "out", batching="longest", data=f"  data_path: {tmp_path / 'nope.jsonl'}"
    )
    config = load_config(write_yaml(text), mode="validate").config
    w = Workload.from_config(config)
    assert w.seq_len == 128
    assert "assumed batches reach max_seq_len" in w.note
    assert any("max_seq_len" in n for n in estimate(config, "cpu").notes)


def test_data_over_the_scan_limit_is_not_read(write_yaml, tmp_path, monkeypatch) -> None:
    from bmtrain_cli.plan import data_facts as facts_module

    monkeypatch.setattr(facts_module, "SCAN_LIMIT_BYTES", 1000)  # the demo data is larger
    config = _config(write_yaml, tmp_path)
    facts = data_facts(config)
    assert facts.longest is None and facts.vocab_size  # the tokenizer is still read
    assert "was not scanned" in facts.note and "assumed batches reach max_seq_len" in facts.note
