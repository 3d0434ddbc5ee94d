from __future__ import annotations

import json

import pytest

from bmtrain_cli.data.tokenizers import load_tokenizer, train_sentencepiece
from bmtrain_cli.errors import UserError


def test_sentencepiece_roundtrip_and_save(tmp_path, sp_tok):
    assert sp_tok.bos_id == 1 and sp_tok.eos_id == 2 and sp_tok.pad_id == 3 and sp_tok.add_bos
    ids = sp_tok.encode("12+35=")
    assert len(ids) == 6  # digits are one token each, no dummy prefix
    assert sp_tok.decode(ids) == "12+35="
    assert sp_tok.decode(sp_tok.encode("Hello, world!\n")) == "Hello, world!\n"
    sp_tok.save(str(tmp_path / "copy"))
    again = load_tokenizer(str(tmp_path / "copy"))
    assert again.encode("99+1=100") == sp_tok.encode("99+1=100")
    assert again.fingerprint() == sp_tok.fingerprint()
    assert (again.bos_id, again.eos_id, again.pad_id) == (1, 2, 3)


def test_byte_fallback_handles_unseen_characters(tmp_path):
    tok = train_sentencepiece(["1+1=2", "2+2=4"], str(tmp_path), vocab_size=64)
    text = "你好 ünïcode"
    assert tok.decode(tok.encode(text)) == text


def _hf_tokenizer_dir(tmp_path, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world", "the answer is 42", "user assistant system"], trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    d = tmp_path / "hf"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    if chat_template:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hf_tokenizer_specials_and_template(tmp_path):
    d = _hf_tokenizer_dir(tmp_path, CHATML_JINJA)
    tok = load_tokenizer(str(d))
    assert tok.bos_id is None and not tok.add_bos
    assert tok.eos_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.chat_template == CHATML_JINJA
    assert tok.decode(tok.encode("hello world")) == "hello world"
    tok.save(str(tmp_path / "saved"))
    again = load_tokenizer(str(tmp_path / "saved"))
    assert again.chat_template == CHATML_JINJA and again.eos_id == tok.eos_id and again.pad_id == tok.pad_id
    assert again.encode("the answer") == tok.encode("the answer")


def test_missing_tokenizer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))


def test_ids_past_the_vocabulary_decode_to_nothing(sp_tok):
    """A model whose vocab_size pads the tokenizer's can emit those ids: decoding them raised IndexError."""
    ids = sp_tok.encode("12+3")
    n = sp_tok.vocab_size
    assert sp_tok.decode(ids + [n, n + 7]) == sp_tok.decode(ids) == "12+3"


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_encode_offsets_are_character_spans(tmp_path, sp_tok, kind):
    """encode_offsets gives encode's ids and each token's character span (sentencepiece counts bytes:
    Chinese and emoji are several bytes a character)."""
    tok = sp_tok if kind == "sentencepiece" else load_tokenizer(str(_hf_tokenizer_dir(tmp_path)))
    text = "Assistant: Fine 你好🙂 12+35=47"
    ids, spans = tok.encode_offsets(text)
    assert ids == tok.encode(text)
    assert len(spans) == len(ids)
    assert all(0 <= a <= b <= len(text) for a, b in spans)
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)
    assert spans[-1][1] == len(text)
    # every character lies in some token's span (a byte-fallback character's tokens share its span)
    covered = {i for a, b in spans for i in range(a, b)}
    assert {i for i, ch in enumerate(text) if ch != " "} <= covered
