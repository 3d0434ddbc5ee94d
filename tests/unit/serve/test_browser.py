"""The web chat page at ``/`` in a real headless browser: Debian's chromium (apt-get install chromium),
driven through the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages on file descriptors
3 and 4; no driver or client library needed). A message typed into the page is answered by a reply that
streams in (several partial texts before the full one) and equals the server's greedy answer to the same
messages; a second message is answered with the first turn in its history. Skipped when chromium is not
installed."""

from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import httpx
import pytest

from tests.unit.serve.conftest import ServerProcess

pytestmark = pytest.mark.slow

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-pipe",
]
MAX_TOKENS = 40
TIMEOUT = 120


def _chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """A headless chromium and one page of it, spoken to with DevTools protocol commands."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_browser, self._send_fd = os.pipe()
        self._recv_fd, from_browser = os.pipe()

        def wire() -> None:  # in the child: the protocol's fds 3 (commands in) and 4 (replies out)
            a = fcntl.fcntl(to_browser, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_browser, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            preexec_fn=wire,
            pass_fds=(3, 4),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._replies: queue.Queue[Dict[str, Any]] = queue.Queue()
        self._next = 0
        threading.Thread(target=self._read, daemon=True).start()
        self.session: Optional[str] = None

    def _read(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self._recv_fd, 65536)
            if not chunk:
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    self._replies.put(msg)

    def call(self, method: str, **params: Any) -> Dict[str, Any]:
        self._next += 1
        msg: Dict[str, Any] = {"id": self._next, "method": method, "params": params}
        if self.session is not None and not method.startswith("Target."):
            msg["sessionId"] = self.session
        os.write(self._send_fd, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._replies.get(timeout=TIMEOUT)
            if reply["id"] == self._next:
                assert "error" not in reply, (method, reply["error"])
                return dict(reply.get("result", {}))

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.wait("document.readyState === 'complete' && !!document.getElementById('input')")

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait(self, condition: str) -> None:
        deadline = time.time() + TIMEOUT
        while not self.js(f"Boolean({condition})"):
            assert time.time() < deadline, f"the page did not reach {condition!r} within {TIMEOUT} s"
            time.sleep(0.05)

    def type_into(self, element_id: str, text: str, enter: bool = False) -> None:
        """Focus an input and type ``text`` as keyboard input (then Enter)."""
        self.js(f"document.getElementById({element_id!r}).focus()")
        self.call("Input.insertText", text=text)
        if enter:
            key = {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13}
            self.call("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
            self.call("Input.dispatchKeyEvent", type="keyUp", **key)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self._send_fd)


# records the text of the reply being written after every change the page makes to the log
WATCH = """
window.seen = [];
new MutationObserver(() => {
  const last = document.getElementById('log').lastElementChild;
  if (last && last.classList.contains('assistant')) window.seen.push(last.textContent);
}).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
"""


@pytest.fixture(scope="module")
def page_server(model_dir) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--model_path", str(model_dir), "--max-tokens", "256"])
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def browser(tmp_path) -> Iterator[Browser]:
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium chromium-driver)")
    b = Browser(binary, tmp_path / "profile")
    try:
        yield b
    finally:
        b.close()


def _greedy(srv: ServerProcess, messages: List[Dict[str, str]]) -> str:
    body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def _ask(browser: Browser, text: str, turn: int) -> List[str]:
    """Type ``text`` and press Enter; the texts the reply showed while it streamed in (the last: all)."""
    browser.js("window.seen = []")
    browser.type_into("input", text, enter=True)
    browser.wait(f"document.querySelectorAll('.assistant[data-done]').length === {turn}")
    return list(browser.js("window.seen"))


def test_the_chat_page_streams_replies_and_keeps_the_conversation(page_server, browser):
    first, second = "1 + 2 =", "3 + 4 = 7"
    want_first = _greedy(page_server, [{"role": "user", "content": first}])
    history = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": want_first},
        {"role": "user", "content": second},
    ]
    want_second = _greedy(page_server, history)
    alone = _greedy(page_server, [{"role": "user", "content": second}])
    assert want_first.strip() and want_second.strip()
    assert want_second != alone  # so the second reply shows whether the first turn was sent with it

    browser.open(page_server.url + "/")
    browser.js(WATCH)
    browser.type_into("max_tokens", str(MAX_TOKENS))
    seen = _ask(browser, first, 1)
    assert seen[-1] == want_first
    partial = [t for t in seen if t and t != want_first]
    assert partial and all(want_first.startswith(t) for t in partial), seen  # it streamed in

    seen = _ask(browser, second, 2)
    assert seen[-1] == want_second
    shown = browser.js("Array.from(document.querySelectorAll('.msg')).map(d => [d.className, d.textContent])")
    assert shown == [
        ["msg user", first],
        ["msg assistant", want_first],
        ["msg user", second],
        ["msg assistant", want_second],
    ]
    assert not browser.js("document.getElementById('input').value")  # the input was cleared on send
