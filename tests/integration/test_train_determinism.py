"""A one-process fp32 CPU run is bit-reproducible (issue 28): two runs of the same config, the second with
the machine busy (a CPU-bound process per core), give identical per-step losses and gradient norms and
identical bytes in the final weights. The model is sized so that our kernels take their threaded paths
(gradient norm over more than 4 Mi elements, attention with b x kv heads below 64 so the K/V gradients
are summed over chunks), with packing, grouped-query attention, warmup, recompute and clipping active."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny import model_yaml

CONFIG = (
    model_yaml(
        max_seq_len=256,
        kv_heads=2,
        kernels="custom",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        vocab_size=12288,
    )
    + """train_config:
  demo_data: arithmetic
  output_dir: {out}
  batching: packed
  max_steps: 5
  micro_batch_size: 4
  learning_rate: 3.0e-3
  warmup_steps: 2
  max_grad_norm: 0.05
  gradient_checkpointing: true
  logging_steps: 1
  save_steps: 5
  num_workers: 0
"""
)

pytestmark = pytest.mark.slow


def _spin(stop) -> None:  # pragma: no cover - runs in a child process
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def _train(tmp_path: Path, name: str, threads: str = "2") -> tuple:
    out = tmp_path / name
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(CONFIG.format(out=out), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS=threads)
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [(m["step"], m["loss"], m["grad_norm"]) for m in lines if "loss" in m and "grad_norm" in m]
    weights = sorted((out / "checkpoints").glob("step-5/**/*.safetensors"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in weights)).hexdigest()
    return steps, digest, weights


def test_two_runs_are_identical_bit_for_bit_under_load(tmp_path):
    quiet_steps, quiet_weights, files = _train(tmp_path, "quiet")
    assert len(quiet_steps) == 5 and files
    # clipping fired: every recorded pre-clip norm is above max_grad_norm
    assert all(g > 0.05 for _, _, g in quiet_steps)
    stop = multiprocessing.Event()
    load = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(os.cpu_count() or 2)]
    for p in load:
        p.start()
    try:
        busy_steps, busy_weights, _ = _train(tmp_path, "busy")
    finally:
        stop.set()
        for p in load:
            p.join()
    assert busy_steps == quiet_steps
    assert busy_weights == quiet_weights
