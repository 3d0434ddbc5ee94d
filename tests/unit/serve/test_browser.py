"""The chat page in a real headless Chromium: open /#ask=hello, let the page's script stream the reply
from /v1/chat/completions, and compare the rendered reply with the API's greedy answer (slow; skips where
Chromium is absent)."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import tempfile

import httpx
import pytest

from tests.unit.serve.conftest import ServerProcess

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_page_streams_a_reply_in_headless_chromium(model_dir):
    srv = ServerProcess(["--model_path", str(model_dir), "--max-tokens", "12"])
    try:
        msgs = [{"role": "user", "content": "hello"}]
        want = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "temperature": 0}).json()
        want_text = want["choices"][0]["message"]["content"]
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tempfile.mkdtemp()}",
            "--virtual-time-budget=30000",
            "--dump-dom",
        ]
        r = subprocess.run(
            [CHROMIUM, *flags, srv.url + "/#ask=hello"], capture_output=True, text=True, timeout=120
        )
        bubbles = re.findall(r'<div class="msg (\w+)"([^>]*)>(.*?)</div>', r.stdout, re.S)
        assert [b[0] for b in bubbles] == ["user", "assistant"], r.stdout[-2000:] + r.stderr[-2000:]
        assert 'data-done="1"' in bubbles[1][1]
        assert html.unescape(bubbles[1][2]) == want_text
    finally:
        assert srv.stop() == 0
