"""A tiny model (sentencepiece tokenizer), a LoRA adapter over it, and real `bmtrain serve` processes on
free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator, List

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[3]
API_KEY = "sk-test-key"


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory) -> Path:
    import paddle

    from bmtrain_cli.data.tokenizers import train_sentencepiece
    from bmtrain_cli.models import build, save_pretrained
    from tests.unit.models.tiny import TINY

    d = tmp_path_factory.mktemp("serve") / "serve_model"  # the served model's id
    d.mkdir()
    texts = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)] + ["hello world"] * 10
    tok = train_sentencepiece(texts, str(d), vocab_size=300)
    paddle.seed(0)
    arch = replace(TINY, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    save_pretrained(build(arch), d)
    return d


@pytest.fixture(scope="package")
def lora_dirs(model_dir, tmp_path_factory):
    """(base, adapter): the tiny model as the base and a LoRA adapter checkpoint (non-zero B) over it."""
    import shutil

    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.models import load_pretrained
    from bmtrain_cli.train.lora_run import LoRARun
    from tests.unit.lora.conftest import lora_cfg, randomize_adapters

    tmp = tmp_path_factory.mktemp("serve_lora")
    model = load_pretrained(str(model_dir))
    cfg = Config.model_validate(
        {
            "model_config": {"model_name_or_path": str(model_dir)},
            "train_config": lora_cfg(["q_proj", "v_proj", "down_proj"]).model_dump(),
        }
    )
    run = LoRARun.start(model, cfg.train)
    randomize_adapters(model, scale=0.5)
    run.record_base(cfg, tmp / "out", model)
    ckpt = tmp / "step-1"
    ckpt.mkdir()
    run.weights_writer(model)(model, str(ckpt))
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, ckpt / f.name)
    return model_dir, ckpt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: List[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "bmtrain_cli", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.time() + 240
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"bmtrain serve exited {self.proc.returncode}: {self.proc.stdout.read()}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.proc.kill()
        raise AssertionError("bmtrain serve did not answer /health within 240 s")

    def stop(self) -> int:
        """SIGTERM: finish in-flight requests and exit; the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="package")
def server(model_dir) -> Iterator[ServerProcess]:
    srv = ServerProcess(["--model_path", str(model_dir), "--api-key", API_KEY, "--max-tokens", "64"])
    yield srv
    assert srv.stop() == 0
