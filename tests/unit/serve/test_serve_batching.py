"""Continuous batching in a real `bmtrain serve` process: concurrent requests that join at different
decode steps give `bmtrain generate`'s greedy text and their own seeded samples, a client that goes away
stops its generation, a full queue answers 503 at once, and SIGTERM lets in-flight replies finish.

"3 + 4 = 7" is the prompt for long replies: on the tiny model of conftest.model_dir its greedy reply runs
past 1500 tokens without EOS (the tests below check the counts they rely on)."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List

import httpx
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.unit.serve.conftest import ServerProcess

pytestmark = pytest.mark.slow

LONG = "3 + 4 = 7"
# (prompt, max_tokens): prompts of different lengths, replies of different lengths
MIXED = [
    (LONG, 160),
    ("hello", 40),
    ("1 + 2 =", 25),
    ("12", 60),
    ("29 + 29 =", 12),
    ("5 + 5 = 10 5 + 5 =", 30),
]
TIMEOUT = 120


class Gone(Exception):
    """A client leaving in the middle of a stream."""


@pytest.fixture(scope="module")
def batching_server(model_dir):
    srv = ServerProcess(
        ["--model_path", str(model_dir), "--max-tokens", "1500", "--max-queue", "8", "--max-batch", "8"]
    )
    yield srv
    assert srv.stop() == 0


def _generate(model_dir, prompt: str, n: int, *extra: str) -> str:
    """`bmtrain generate`'s text for one prompt (its stdout less the final newline)."""
    cmd = ["generate", "--model_path", str(model_dir), "--prompt", prompt, "--max_new_tokens", str(n), *extra]
    r = CliRunner().invoke(app, cmd)
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith("\n")
    return r.stdout[:-1]


def _stats(srv: ServerProcess) -> Dict[str, int]:
    return httpx.get(srv.url + "/health", timeout=10).json()["batching"]


def _idle(srv: ServerProcess) -> Dict[str, int]:
    """The scheduler's counters once no row is active (within 30 s)."""
    deadline = time.time() + 30
    while (stats := _stats(srv))["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert stats["active"] == 0, stats
    return stats


def _complete(srv: ServerProcess, **body: Any) -> Dict[str, Any]:
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(srv: ServerProcess, body: Dict[str, Any], on_chunk: Callable[[int], None]) -> str:
    """A streamed completion's text; ``on_chunk(k)`` runs after the k-th text chunk arrived."""
    import json

    text, k = [], 0
    with httpx.stream(
        "POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line or line == "data: [DONE]":
                continue
            piece = json.loads(line[len("data: ") :])["choices"][0]["text"]
            if piece:
                text.append(piece)
                k += 1
                on_chunk(k)
    return "".join(text)


def _run_all(fns: List[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=f) for f in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not any(t.is_alive() for t in threads)


def test_requests_joining_at_different_steps_equal_bmtrain_generate(batching_server, model_dir):
    """Each streamed request starts once the one before it has 3 chunks of text, so every request joins
    a batch already decoding; some are non-streaming and all start at once on top. Every text equals
    `bmtrain generate`'s for its prompt and max_new_tokens."""
    want = [_generate(model_dir, p, n) for p, n in MIXED]
    before = _idle(batching_server)
    got: Dict[int, str] = {}
    started = [threading.Event() for _ in MIXED]
    errors: List[BaseException] = []

    def streamed(i: int) -> Callable[[], None]:
        def run() -> None:
            started[i].wait(TIMEOUT)
            prompt, n = MIXED[i]

            def chunk(k: int) -> None:
                if k == 3 and i + 1 < len(MIXED):
                    started[i + 1].set()

            try:
                got[i] = _stream(
                    batching_server, {"prompt": prompt, "max_tokens": n, "temperature": 0}, chunk
                )
            except BaseException as exc:  # asserted below
                errors.append(exc)
            finally:
                if i + 1 < len(MIXED):
                    started[i + 1].set()  # a reply shorter than 3 chunks still lets the next one go

        return run

    def whole(i: int) -> Callable[[], None]:
        def run() -> None:
            prompt, n = MIXED[i]
            got[100 + i] = _complete(batching_server, prompt=prompt, max_tokens=n, temperature=0)["choices"][
                0
            ]["text"]

        return run

    started[0].set()
    _run_all([streamed(i) for i in range(len(MIXED))] + [whole(i) for i in (0, 2, 4)])
    assert not errors, errors
    assert [got[i] for i in range(len(MIXED))] == want
    assert [got[100 + i] for i in (0, 2, 4)] == [want[0], want[2], want[4]]
    after = _idle(batching_server)
    steps, tokens = after["steps"] - before["steps"], after["tokens"] - before["tokens"]
    assert after["widest"] >= 3  # requests really were decoded together
    assert steps < tokens - len(MIXED) - 3  # fewer forwards than one per token: steps were shared


def test_seeded_samples_do_not_depend_on_the_batch(batching_server):
    """A sampled request alone, then the same request among others (greedy, other seeds, n 3 whose
    choices take seeds 41, 42, 43): the same text every time."""
    sampled = {"prompt": "hello", "max_tokens": 30, "temperature": 1.0, "top_p": 0.9}
    alone = {s: _complete(batching_server, **sampled, seed=s)["choices"][0]["text"] for s in (41, 42)}
    assert alone[41] != alone[42]
    got: Dict[str, Any] = {}

    def req(name: str, **body: Any) -> Callable[[], None]:
        return lambda: got.__setitem__(name, _complete(batching_server, **body)["choices"])

    _run_all(
        [
            req("a", **sampled, seed=41),
            req("n", **sampled, seed=41, n=3),
            req("other", prompt=LONG, max_tokens=80, temperature=0.7, seed=5),
            req("greedy", prompt="12", max_tokens=50, temperature=0),
        ]
    )
    assert got["a"][0]["text"] == alone[41]
    assert [c["text"] for c in got["n"][:2]] == [alone[41], alone[42]]
    assert len({c["text"] for c in got["n"]}) == 3


def _cancelled_run(srv: ServerProcess, leave: Callable[[], None]) -> Dict[str, int]:
    """Counter changes while ``leave`` starts a long reply and goes away early."""
    before = _idle(srv)
    leave()
    after = _idle(srv)
    return {k: after[k] - before[k] for k in ("tokens", "cancelled")}


def test_a_streaming_client_that_leaves_stops_its_generation(batching_server):
    def chunk(k: int) -> None:
        if k == 2:
            raise Gone

    def leave() -> None:
        with pytest.raises(Gone):
            _stream(batching_server, {"prompt": LONG, "max_tokens": 1500, "temperature": 0}, chunk)

    delta = _cancelled_run(batching_server, leave)
    assert delta["cancelled"] == 1 and delta["tokens"] < 300, delta  # not the 1500 asked for


def test_a_non_streaming_client_that_leaves_stops_its_generation(batching_server):
    def leave() -> None:
        body = {"prompt": LONG, "max_tokens": 1500, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(batching_server.url + "/v1/completions", json=body, timeout=0.4)

    delta = _cancelled_run(batching_server, leave)
    assert delta["cancelled"] == 1 and delta["tokens"] < 750, delta
    # the full reply would have used all 1500: the count above is the client leaving, not an EOS
    full = _complete(batching_server, prompt=LONG, max_tokens=1500, temperature=0)
    assert full["usage"]["completion_tokens"] == 1500


def test_a_full_queue_answers_503_at_once(batching_server):
    """8 long streams hold the queue's 8 places: the next request is refused at once, and answered once
    they are done."""
    holding = threading.Barrier(9, timeout=TIMEOUT)
    stop = threading.Event()

    def hold() -> None:
        def chunk(k: int) -> None:
            if k == 1:
                holding.wait()
            if stop.is_set():
                raise Gone

        try:
            _stream(batching_server, {"prompt": LONG, "max_tokens": 1500, "temperature": 0}, chunk)
        except Gone:
            pass

    threads = [threading.Thread(target=hold) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        holding.wait()
        t0 = time.time()
        r = httpx.post(
            batching_server.url + "/v1/completions", json={"prompt": "12", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"], r.text
        assert time.time() - t0 < 2
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=TIMEOUT)
    _idle(batching_server)
    assert _complete(batching_server, prompt="12", max_tokens=4)["usage"]["completion_tokens"] == 4


def test_sigterm_finishes_in_flight_requests_and_exits_0(model_dir):
    """SIGTERM while a non-streaming and a streaming reply are being decoded: both arrive whole (equal to
    the same requests before), then the process exits 0."""
    srv = ServerProcess(["--model_path", str(model_dir), "--max-tokens", "1500"])
    try:
        body = {"prompt": LONG, "max_tokens": 400, "temperature": 0}
        want = _complete(srv, **body)["choices"][0]["text"]
        got: Dict[str, str] = {}
        streaming = threading.Event()

        def whole() -> None:
            got["whole"] = _complete(srv, **body)["choices"][0]["text"]

        def streamed() -> None:
            got["stream"] = _stream(srv, body, lambda k: k == 1 and streaming.set())

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        assert streaming.wait(60)
        deadline = time.time() + 30
        while _stats(srv)["active"] < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert _stats(srv)["active"] == 2
        code = srv.stop()
        for t in threads:
            t.join(timeout=TIMEOUT)
        assert got == {"whole": want, "stream": want}
        assert code == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
