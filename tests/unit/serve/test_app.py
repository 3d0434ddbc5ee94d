"""The server's app in-process (Starlette's TestClient) over a tiny model: the fast suite's coverage of
the API; test_serve.py runs it as a real process."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app as cli_app
from tests.unit.serve.conftest import REPO

PROMPT = "1 + 2 ="


@pytest.fixture(scope="module")
def client(model_dir):
    from starlette.testclient import TestClient

    from bmtrain_cli.export.any_model import load_model_and_tokenizer as _load
    from bmtrain_cli.serve.app import Server, build_app
    from bmtrain_cli.serve.engine import Engine

    model, tok = _load(model_dir, None, "float32")
    server = Server(Engine(model, tok, "tiny", max_queue=4), api_key="k", max_tokens=32)
    with TestClient(build_app(server), headers={"Authorization": "Bearer k"}) as c:
        yield c


def _generate(model_dir):
    r = CliRunner().invoke(
        cli_app, ["generate", "--model_path", str(model_dir), "--prompt", PROMPT, "--max_new_tokens", "6"]
    )
    assert r.exit_code == 0, r.output
    return r.stdout.rstrip("\n")


def test_greedy_completion_equals_generate_and_streams_the_same(client, model_dir):
    want = _generate(model_dir)
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    assert r.json()["usage"]["completion_tokens"] == 6
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_uses_the_template_and_stop_strings(client):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0})
    text = r.json()["choices"][0]["message"]["content"]
    assert r.status_code == 200 and len(text) > 2
    stop = text[1:3]
    r = client.post(
        "/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "temperature": 0, "stop": stop}
    )
    assert r.json()["choices"][0]["message"]["content"] == text[: text.find(stop)]
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_auth_errors_and_page(client):
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    page = client.get("/", headers={"Authorization": ""}).text
    assert "/v1/chat/completions" in page and "stream: true" in page
    for body, status in (
        (b"{", 400),
        (b'"x"', 400),
        (b'{"prompt": "\xff"}', 400),
        (json.dumps({"prompt": PROMPT, "model": "other"}).encode(), 404),
        (json.dumps({"prompt": PROMPT, "max_tokens": 33}).encode(), 400),
        (json.dumps({"prompt": PROMPT, "temperature": -0.5}).encode(), 400),
        (json.dumps({"prompt": "5" * 3000}).encode(), 400),
    ):
        r = client.post("/v1/completions", content=body)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_text_stream_holds_back_a_possible_stop_string():
    from bmtrain_cli.serve.engine import TextStream

    class Chars:
        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    seen = []
    s = TextStream(Chars(), ["END"], seen.append)
    stopped = [s.push(ord(c)) for c in "abEN"]
    assert not any(stopped) and "".join(seen) == "ab"  # "EN" could still become "END"
    assert s.push(ord("D")) and s.finish() == "abEN"[:2] and "".join(seen) == "ab"
    s = TextStream(Chars(), ["END"], seen.append)
    for c in "xEy":
        s.push(ord(c))
    assert s.finish() == "xEy"


@pytest.mark.parametrize("kind", ["byte_level_bpe", "sentencepiece"])
def test_text_stream_decodes_incrementally_as_the_whole_text(kind, model_dir):
    """Real tokenizers (SmolLM2's byte-level BPE test tokenizer, the sentencepiece one of conftest's model),
    text with spaces, multi-byte characters spelled in byte tokens and a stop string across tokens: the
    streamed deltas add up to the decode of all the ids, cut at the stop string."""
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.serve.engine import TextStream

    path = REPO / "tests/fixtures/chat_parity/smollm2" if kind == "byte_level_bpe" else model_dir
    tok = load_tokenizer(str(path))
    text = "hello world 1 + 2 = 3 caf\u00e9 \u4e2d\u6587 the end. 12 + 13 = 25 hello"
    ids = tok.encode(text)
    full = tok.decode(ids)
    for stop in ([], ["= 25"], ["\u6587 th", "nope"]):
        seen: list = []
        stream = TextStream(tok, stop, seen.append)
        stopped = False
        for t in ids:
            if stream.push(t):
                stopped = True
                break
        got = stream.finish()
        cut = min([full.find(x) for x in stop if x in full], default=-1)
        want = full if cut < 0 else full[:cut]
        assert (got, "".join(seen), stopped) == (want, want, cut >= 0), stop
        assert len(seen) > 3  # it streamed, not all at the end


def test_serve_without_the_extra_names_it(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    r = CliRunner().invoke(cli_app, ["serve", "--model_path", str(tmp_path)])
    assert r.exit_code == 2 and "pip install 'bmtrain-cli[serve]'" in r.output and "Traceback" not in r.output
