"""`bmtrain serve` in a real process, talked to by the official openai client and by raw HTTP (slow: each
process loads Paddle; test_app.py runs the same app in-process in the fast suite)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.unit.serve.conftest import API_KEY, REPO, ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "1 + 2 ="
MODEL = "serve_model"  # the model directory's name (see conftest.model_dir)
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def _generate(model_path, *extra):
    r = CliRunner().invoke(
        app,
        ["generate", "--model_path", str(model_path), "--prompt", PROMPT, "--max_new_tokens", "6", *extra],
    )
    assert r.exit_code == 0, r.output
    return r.stdout.rstrip("\n")


def test_models_list_and_health(server):
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_greedy_completion_equals_bmtrain_generate(server, model_dir):
    want = _generate(model_dir)
    r = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.choices[0].finish_reason == "length"


def test_chat_streaming_equals_non_streaming(server):
    client = _client(server)
    msgs = [{"role": "user", "content": "hello"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text and len(chunks) > 2
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_seeded_sampling_repeats_and_stop_strings_cut(server, model_dir):
    client = _client(server)
    a, b = (
        client.completions.create(prompt=PROMPT, model=MODEL, max_tokens=12, temperature=1.0, seed=7)
        for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text
    full = _generate(model_dir)
    stop = full[2:4]
    r = client.completions.create(prompt=PROMPT, model=MODEL, max_tokens=6, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"
    n = client.completions.create(prompt=PROMPT, model=MODEL, max_tokens=4, temperature=1.0, n=3, seed=1)
    assert [c.index for c in n.choices] == [0, 1, 2]


def test_wrong_api_key_is_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/").status_code == 200  # the page itself is open (it asks for the key)


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{bad json", 400, "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": PROMPT, "model": "gpt-4"}).encode(), 404, "does not exist"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 65}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"prompt": PROMPT, "top_p": "x"}).encode(), 400, "top_p"),
        (json.dumps({"prompt": PROMPT, "stop": [1]}).encode(), 400, "stop"),
        (json.dumps({"prompt": PROMPT, "stream": True, "n": 2}).encode(), 400, "n 1"),
        (json.dumps({"prompt": "7" * 3000}).encode(), 400, "context"),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (b"x" * (2 << 20), 413, "limit"),
    ],
)
def test_bad_completion_requests(server, body, status, words):
    r = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and "Traceback" not in r.text


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "non-empty"),
        ([{"role": "assistant", "content": "hi"}], "end with a user"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "alternate"),
        ([{"role": "wizard", "content": "a"}, {"role": "user", "content": "b"}], "role"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "text parts"),
    ],
)
def test_bad_chat_requests(server, messages, words):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, headers=AUTH)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_unknown_route_and_method(server):
    assert httpx.get(server.url + "/v1/nothing", headers=AUTH).json()["error"]["type"] == "not_found_error"
    assert httpx.get(server.url + "/v1/completions", headers=AUTH).status_code == 405


def test_concurrent_clients_all_answered_equal(server, model_dir):
    """8 clients x 2 greedy requests at once: all answered (one at a time), all equal to generate's."""
    want = _generate(model_dir)
    got, errors = [], []

    def client_loop():
        c = _client(server)
        for _ in range(2):
            try:
                r = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
                got.append(r.choices[0].text)
            except Exception as exc:  # collected and asserted below
                errors.append(exc)

    threads = [threading.Thread(target=client_loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == [want] * 16


def test_page_streams_from_the_chat_endpoint(server):
    page = httpx.get(server.url + "/").text
    assert "/v1/chat/completions" in page and "stream: true" in page and "getReader" in page
    assert "http://" not in page and "https://" not in page  # no external assets: works offline


def test_chat_command_over_piped_stdin(server, model_dir):
    """`bmtrain chat`: the first greedy reply equals the server's; /system and /reset; /exit ends it."""
    msgs = [{"role": "user", "content": "hello"}]
    want = (
        _client(server)
        .chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
        .choices[0]
        .message.content
    )
    cmd = [
        sys.executable,
        "-m",
        "bmtrain_cli",
        "chat",
        "--model_path",
        str(model_dir),
        "--max_new_tokens",
        "5",
    ]
    stdin = "hello\n\nagain\n/system be brief\nhello\n/reset\n/bogus\n/exit\nnever sent\n"
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr
    replies = r.stdout.split("\n")
    assert replies[0] == want and len([x for x in replies if x or x == ""]) >= 3
    assert (
        "system prompt set" in r.stderr and "conversation reset" in r.stderr and "unknown command" in r.stderr
    )


def test_lora_adapter_over_its_base_equals_the_merged_model(lora_dirs):
    base, adapter = lora_dirs
    merged = _generate(adapter)  # `bmtrain generate` on an adapter checkpoint merges it into the base
    assert merged != _generate(base)
    srv = ServerProcess(["--model_path", str(base), "--adapter", str(adapter)])
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=adapter.name, prompt=PROMPT, max_tokens=6, temperature=0)
        assert r.choices[0].text == merged
    finally:
        assert srv.stop() == 0


def test_many_simultaneous_streams_get_answers_or_503(server):
    """150 streams at once against a queue of 64: each gets a whole stream ending with [DONE] or a 503
    JSON error; none is lost and the server answers afterwards."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    outcomes = []

    def one():
        try:
            with httpx.stream(
                "POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120
            ) as r:
                lines = [line for line in r.iter_lines() if line]
                ok = r.status_code == 200 and lines[-1] == "data: [DONE]"
                busy = r.status_code == 503 and "busy" in json.loads(lines[0])["error"]["message"]
                outcomes.append("ok" if ok else "busy" if busy else f"bad {r.status_code}")
        except httpx.HTTPError as exc:
            outcomes.append(f"error {exc!r}")

    threads = [threading.Thread(target=one) for _ in range(150)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(outcomes) == 150 and set(outcomes) <= {"ok", "busy"}, sorted(set(outcomes))
    assert outcomes.count("ok") >= 64
    assert httpx.get(server.url + "/health").status_code == 200
