"""Chat records with tools, tool calls, tool results, reasoning and per-turn loss flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.formats import BadRecord, parse_record
from bmtrain_cli.data.templates import get_template
from bmtrain_cli.data.tokenizers import load_tokenizer
from bmtrain_cli.data.tools import tool_turns
from bmtrain_cli.data.turns import RenderOptions
from bmtrain_cli.errors import UserError

QWEN3 = Path(__file__).resolve().parents[2] / "fixtures" / "chat_parity" / "qwen3"

GLAIVE = {
    "conversations": [
        {"from": "human", "value": "Convert 500 USD to EUR"},
        {"from": "function_call", "value": '{"name": "convert", "arguments": {"amount": 500, "to": "EUR"}}'},
        {"from": "observation", "value": '{"converted": 425.5}'},
        {"from": "gpt", "value": "500 USD is 425.50 EUR."},
    ],
    "tools": '[{"name": "convert", "description": "Convert currency", "parameters": {"type": "object"}}]',
}


def test_sharegpt_function_call_and_observation():
    conv = parse_record(GLAIVE)
    assert [r for r, _ in conv.messages] == ["user", "assistant", "tool", "assistant"]
    call = conv.extras[1]["tool_calls"][0]["function"]
    assert call == {"name": "convert", "arguments": {"amount": 500, "to": "EUR"}}
    assert conv.tools[0]["name"] == "convert"
    assert tool_turns(conv) == (1, 1)


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}], "must follow an assistant"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": []}],
            "non-empty list",
        ),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0.5}], "0 or 1"),
        ([{"role": "user", "content": "q"}, {"from": "function_call", "value": "{oops"}], "not valid JSON"),
    ],
)
def test_bad_tool_records(messages, reason):
    with pytest.raises(BadRecord, match=reason):
        parse_record({"messages": messages})


def test_builtin_template_refuses_tools_by_name():
    with pytest.raises(UserError, match="template 'chatml' cannot render tools"):
        get_template("chatml").render(parse_record(GLAIVE))


def test_template_without_tools_refused():
    tok = load_tokenizer(str(QWEN3))
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(UserError, match="does not render tools"):
        make_encoder(tok, "tokenizer").encode(parse_record(GLAIVE))


def test_loss_flag_and_mask_history():
    tok = load_tokenizer(str(QWEN3))
    msgs = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first", "loss": False},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "third"},
    ]
    conv = parse_record({"messages": msgs})

    def trained(**opts):
        ids, mask = make_encoder(tok, "auto", False, RenderOptions(**opts)).encode(conv)
        return tok.decode([i for i, m in zip(ids, mask) if m])

    assert "first" not in trained() and "second" in trained() and "third" in trained()
    assert "second" not in trained(mask_history=True) and "third" in trained(mask_history=True)


def test_history_reasoning_drop_and_builtin_reasoning():
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "r2"},
    ]
    conv = parse_record({"messages": msgs})
    text = "".join(t for t, _ in get_template("chatml").render(conv))
    assert "<think>\nr1\n</think>\n\na1" in text and "<think>\nr2\n</think>\n\na2" in text
    tok = load_tokenizer(str(QWEN3))
    enc = make_encoder(tok, "chatml", False, RenderOptions(history_reasoning="drop"))
    ids, _ = enc.encode(conv)
    out = tok.decode(ids, skip_special_tokens=False)
    assert "r1" not in out and "r2" in out
    assert msgs[1]["reasoning_content"] == "r1"


@pytest.mark.parametrize(
    "train, path",
    [
        ({"train_on_prompt": True, "mask_history": True}, "train_config.mask_history"),
        ({"train_on_prompt": True, "train_reasoning": False}, "train_config.train_reasoning"),
    ],
)
def test_loss_options_checked_against_train_on_prompt(tmp_path, train, path):
    from bmtrain_cli.config.checks import check_config
    from bmtrain_cli.config.schema import Config

    cfg = Config.model_validate({"model_config": {"max_seq_len": 64}, "train_config": train})
    assert path in [p.path for p in check_config(cfg) if p.severity == "error"]
    ok = Config.model_validate({"model_config": {"max_seq_len": 64}, "train_config": {"mask_history": True}})
    assert not [p for p in check_config(ok) if p.path == path]
