from __future__ import annotations

import pytest

from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.formats import BadRecord, parse_record
from bmtrain_cli.data.tokenizers import load_tokenizer
from bmtrain_cli.errors import UserError

from .test_tokenizers import CHATML_JINJA, _hf_tokenizer_dir

CHAT = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "answer"},
        {"role": "assistant", "content": "42"},
    ]
}


def trained_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_plain_template_trains_answer_and_eos_only(sp_tok):
    enc = make_encoder(sp_tok, "plain")
    ids, mask = enc.encode(parse_record({"input": "12+35=", "output": "47"}))
    assert ids[0] == sp_tok.bos_id and ids[-1] == sp_tok.eos_id
    assert sp_tok.decode(ids) == "12+35=47"
    assert trained_text(sp_tok, ids, mask) == "47"
    assert mask[-1]  # EOS is trained: the model learns to stop
    ids2, mask2 = make_encoder(sp_tok, "plain", train_on_prompt=True).encode(
        parse_record({"input": "1+1=", "output": "2"})
    )
    assert not mask2[0] and all(mask2[1:])


@pytest.mark.parametrize("name", ["chatml", "qwen", "llama2", "alpaca", "baichuan", "plain"])
def test_builtin_templates_train_only_assistant_turns(sp_tok, name):
    enc = make_encoder(sp_tok, name)
    ids, mask = enc.encode(parse_record(CHAT))
    text = trained_text(sp_tok, ids, mask)
    assert "world" in text and "42" in text
    assert "hello" not in text and "answer" not in text and "brief" not in text
    full = sp_tok.decode(ids)
    assert full.index("hello") < full.index("world") < full.index("answer") < full.index("42")


def test_jinja_chat_template_multi_turn_masks(tmp_path):
    tok = load_tokenizer(str(_hf_tokenizer_dir(tmp_path, CHATML_JINJA)))
    enc = make_encoder(tok, "auto")  # the tokenizer's own chat template
    assert enc.template.name == "tokenizer"
    ids, mask = enc.encode(parse_record(CHAT))
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert trained_text(tok, ids, mask) == "world<|im_end|>\n42<|im_end|>\n"
    # <|im_start|> is one token, not spelled out
    assert ids.count(tok.token_to_id("<|im_start|>")) == 5
    prompt = enc.encode_prompt(parse_record(CHAT))
    assert tok.decode(prompt, skip_special_tokens=False).endswith("answer<|im_end|>\n<|im_start|>assistant\n")
    # the built-in chatml gives the same tokens on the same tokenizer
    ids_b, mask_b = make_encoder(tok, "chatml").encode(parse_record(CHAT))
    assert ids_b == ids


def test_unknown_template_suggests(sp_tok):
    with pytest.raises(UserError, match="did you mean 'chatml'"):
        make_encoder(sp_tok, "chatm")


@pytest.mark.parametrize(
    "record,reason",
    [
        ({"input": "a"}, 'missing field "output"'),
        ({"input": "a", "output": ""}, 'field "output" is empty'),
        ({"input": "a", "output": 3}, 'field "output" must be a string'),
        ({"instruction": "", "output": "x"}, 'field "instruction" is empty'),
        ({"messages": []}, "empty"),
        ({"messages": [{"role": "user", "content": "q"}]}, "no assistant turn"),
        ({"messages": [{"role": "robot", "content": "q"}]}, "role must be one of"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"}]}, "alternate"),
        ({"foo": 1}, "unrecognised record"),
        ([1, 2], "expected a JSON object"),
        ({"text": "  "}, 'field "text" is empty'),
    ],
)
def test_bad_records_have_reasons(record, reason):
    with pytest.raises(BadRecord, match=reason):
        parse_record(record)


def test_formats_detected_per_record():
    assert parse_record({"instruction": "do", "input": "this", "output": "ok", "system": "S"}).messages[
        0
    ] == (
        "user",
        "do\n\nthis",
    )
    assert parse_record({"text": "abc"}).is_text
    conv = parse_record(
        {"conversations": None, "messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    )
    assert conv.messages == (("user", "q"), ("assistant", "a"))


@pytest.mark.parametrize("name", ["plain", "chatml", "llama2"])
def test_batched_encoding_matches_single(sp_tok, name):
    enc = make_encoder(sp_tok, name)
    convs = [
        parse_record(CHAT),
        parse_record({"text": "just text"}),
        parse_record({"input": "1+2=", "output": "3"}),
    ]
    assert enc.encode_many(convs) == [enc.encode(c) for c in convs]
