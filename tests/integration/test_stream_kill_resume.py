"""Streaming mode end to end: kill -9 and --resume give the losses of an uninterrupted run, the worker
processes of a killed run go away, and a bad record mid-run stops cleanly with a checkpoint."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_train_kill_resume import _last_step, _losses
from tests.tiny import model_yaml

CONFIG = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """  tokenizer_path: {tok}
train_config:
  data_path: {data}
  streaming: true
  shuffle_buffer: 40
  data_workers: {workers}
  on_bad_record: {on_bad}
  output_dir: {out}
  max_steps: 12
  micro_batch_size: 8
  global_batch_size: 16
  learning_rate: 3.0e-3
  warmup_steps: 3
  logging_steps: 1
  save_steps: 2
  save_total_limit: 2
"""
)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data

    d = tmp_path_factory.mktemp("streamdemo")
    train, heldout = write_demo_data(str(d), task="arithmetic", seed=0)
    train_demo_tokenizer(str(d / "tok"), [train, heldout])
    return Path(train), d / "tok"


def _config(tmp_path, name, data, tok, workers=1, on_bad="error"):
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.format(tok=tok, data=data, workers=workers, on_bad=on_bad, out=tmp_path / name))
    return cfg


def _cmd(cfg: Path, *extra: str):
    return [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg), *extra]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _processes_naming(text: str):
    """Live processes whose command line holds ``text``."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmd:
            found.append(int(pid))
    return found


def test_sigkill_resume_matches_uninterrupted(tmp_path, demo):
    data, tok = demo
    ref = _config(tmp_path, "ref", data, tok, workers=0)  # in-process tokenising: the same batches
    subprocess.run(_cmd(ref), check=True, env=_env(), timeout=600, capture_output=True)
    reference = _losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, 13))

    cfg = _config(tmp_path, "killed", data, tok, workers=1)
    out = tmp_path / "killed"
    rng = random.Random(99)
    kills = 0
    for target in sorted(rng.sample(range(2, 11), 3)):
        proc = subprocess.Popen(
            _cmd(cfg, "--resume"), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.time() + 300
        while proc.poll() is None and _last_step(out) < target and time.time() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
    assert kills >= 2
    deadline = time.time() + 10  # the killed run's tokenizer workers notice and exit
    while _processes_naming(str(cfg)) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_naming(str(cfg)) == []
    done = subprocess.run(_cmd(cfg, "--resume"), env=_env(), timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _losses(out) == reference
    state = json.loads((out / "checkpoints" / "step-12" / "trainer_state.json").read_text())
    position = state["data"]["ranks"]["0"]["position"]
    assert position["chunk"] >= 4  # 12 steps x 16 samples crossed several buffers of 40


def test_bad_record_mid_run_stops_with_a_checkpoint_then_skip_resumes(tmp_path, demo):
    data, tok = demo
    lines = data.read_text().splitlines()
    lines[99] = '{"input": "1+1=", "output": 2}'  # line 100: in the third buffer of 40 records
    bad = tmp_path / "train.jsonl"
    bad.write_text("\n".join(lines) + "\n")

    ref = _config(tmp_path, "ref", bad, tok, workers=0, on_bad="skip")
    subprocess.run(_cmd(ref), check=True, env=_env(), timeout=600, capture_output=True)
    reference = _losses(tmp_path / "ref")

    cfg = _config(tmp_path, "strict", bad, tok, workers=1)
    out = tmp_path / "strict"
    stopped = subprocess.run(_cmd(cfg), env=_env(), timeout=600, capture_output=True, text=True)
    assert stopped.returncode == 2, stopped.stderr[-2000:]
    message = stopped.stdout + stopped.stderr
    assert f'{bad}:100: field "output" must be a string' in message
    assert "stopped at step 5/12, checkpoint saved in" in message  # 80 samples before the buffer: 5 steps
    assert (out / "checkpoints" / "step-5").is_dir()

    resumed = subprocess.run(
        _cmd(cfg, "--resume", "--set", "train_config.on_bad_record=skip"),
        env=_env(),
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _losses(out) == reference
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(r["file"], r["line"]) for r in rejected] == [(str(bad), 100)]
