"""Token ids we feed equal transformers' apply_chat_template for published chat templates (Qwen3, SmolLM2,
Llama 3.1, ERNIE 4.5, Gemma 2 and 3; chat, tool calls, thinking; English, Chinese, emoji), and the trained runs are the assistant turns. Fixtures:
tests/fixtures/make_chat_parity.py (reference venv); with BMTRAIN_REF_PYTHON set the reference side is
re-run live."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.formats import parse_record
from bmtrain_cli.data.tokenizers import load_tokenizer
from bmtrain_cli.data.turns import RenderOptions

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "chat_parity"
CASES = {c["name"]: c for c in json.loads((ROOT / "cases.json").read_text(encoding="utf-8"))}
EXPECTED = json.loads((ROOT / "expected.json").read_text(encoding="utf-8"))
MARKS = json.loads((ROOT / "templates.json").read_text(encoding="utf-8"))  # each template's end and header


def _encode(key: str, **opts):
    template, name = key.split("/")
    case = CASES[name]
    tok = load_tokenizer(str(ROOT / template))
    record = {"messages": case["messages"], **({"tools": case["tools"]} if "tools" in case else {})}
    options = RenderOptions(enable_thinking=case.get("enable_thinking"), **opts)
    ids, mask = make_encoder(tok, "auto", False, options).encode(parse_record(record))
    return tok, case, ids, mask


def _runs(ids, mask):
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_ids_equal_apply_chat_template(key):
    tok, case, ids, mask = _encode(key)
    marks = MARKS[key.split("/")[0]]
    assert ids == EXPECTED[key]
    runs = _runs(ids, mask)
    answers = [m for m in case["messages"] if m["role"] == "assistant"]
    assert len(runs) == len(answers)
    for run, m in zip(runs, answers):
        text = tok.decode(run, skip_special_tokens=False)
        assert text.rstrip("\n").endswith(marks["end"])
        assert m["content"].split("</think>")[-1].strip() in text
        for call in m.get("tool_calls", []):
            assert call["function"]["name"] in text
        assert marks["header"] not in text  # the header and the prompt are not trained


def test_masked_reasoning_and_history():
    tok, case, ids, mask = _encode("qwen3/thinking_multi_turn", train_reasoning=False)
    assert ids == EXPECTED["qwen3/thinking_multi_turn"]
    trained = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert "4 加 3" not in trained and "<think>" not in trained and "7<|im_end|>" in trained
    _, _, ids2, mask2 = _encode("qwen3/tool_chain_thinking", mask_history=True)
    assert len(_runs(ids2, mask2)) == 1
    last = tok.decode([i for i, m in zip(ids2, mask2) if m], skip_special_tokens=False)
    assert last == "<think>\n\n</think>\n\nParis 18C, Rome 25C.<|im_end|>\n"  # the template's empty block


def test_reference_live(tmp_path):
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    if not ref:
        pytest.skip("set BMTRAIN_REF_PYTHON to a Python with transformers to re-run the reference")
    script = Path(__file__).resolve().parents[2] / "fixtures" / "make_chat_parity.py"
    out = subprocess.run(
        [ref, str(script), str(ROOT)], capture_output=True, text=True, check=True, timeout=600
    )
    assert json.loads(out.stdout) == EXPECTED
