"""Context parallel: per-rank peak tensor memory and throughput of a training step against the context degree.

One process (`bmtrain train`, the baseline) and `bmtrain run` with context_parallel 2 and 4 (BENCH_CP_DEGREES,
default 1,2,4), on rows of BENCH_CP_SEQ tokens (default 8192, one long sample per row) through a model of
SmolLM2-135M's width (hidden 576, intermediate 1536, 9 heads, 3 KV heads, tied embeddings) with
BENCH_CP_LAYERS decoder layers (default 2 of its 30: the 2-core machine cannot run the whole depth at this
length), BENCH_CP_STEPS optimizer steps of one row (default 2; throughput needs 2, step 1 warms up).
Memory is rank 0's peak of live Paddle tensors over the steps (metrics.jsonl ``memory``; every rank holds
the same number of tokens), beside the whole run's (summary.json ``peak_memory_bytes``) and what
`bmtrain plan --device cpu` predicts for it; throughput is tokens per second of the whole group. All runs
share the same machine in one session: compare ratios, not absolute figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SEQ = int(os.environ.get("BENCH_CP_SEQ", "8192"))
LAYERS = int(os.environ.get("BENCH_CP_LAYERS", "2"))
STEPS = int(os.environ.get("BENCH_CP_STEPS", "2"))
DEGREES = [int(x) for x in os.environ.get("BENCH_CP_DEGREES", "1,2,4").split(",")]
CONFIG = """model_config:
  family: llama
  hidden_size: 576
  intermediate_size: 1536
  num_hidden_layers: {layers}
  num_attention_heads: 9
  num_key_value_heads: 3
  tie_word_embeddings: true
  max_seq_len: {seq}
  tokenizer_path: {tok}
train_config:
  data_path: {data}
  template: plain
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 1
  global_batch_size: 1
  warmup_steps: 0
  logging_steps: 1
  save_steps: 1000
parallel_config:
  fault_timeout_s: 3600  # a ring step at 32K tokens can take minutes on 2 shared cores
"""


def _data(root: Path) -> None:
    from bmtrain_cli.data.demo import train_demo_tokenizer

    rng = np.random.default_rng(0)
    with open(root / "long.jsonl", "w") as f:
        for _ in range(4):  # longer than SEQ: every row is truncated to exactly SEQ tokens
            words = ["".join(rng.choice(list("abcdefghij"), 4)) for _ in range(SEQ // 3)]
            f.write(
                json.dumps({"input": " ".join(words[: SEQ // 6]), "output": " ".join(words[SEQ // 6 :])})
                + "\n"
            )
    train_demo_tokenizer(str(root / "tok"), [str(root / "long.jsonl")])


def _predicted(cfg: Path, degree: int) -> int:
    """The per-rank peak `bmtrain plan --config cfg --device cpu` prints (compared with summary.json's)."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.estimator import estimate

    sets = [f"parallel_config.context_parallel={degree}"] if degree > 1 else []
    return estimate(load_config(str(cfg), sets).config, "cpu").peak


def _run(root: Path, degree: int) -> dict:
    out = root / f"cp{degree}"
    cfg = root / f"cp{degree}.yaml"
    cfg.write_text(
        CONFIG.format(
            layers=LAYERS, steps=STEPS, seq=SEQ, tok=root / "tok", data=root / "long.jsonl", out=out
        )
    )
    cmd = [sys.executable, "-m", "bmtrain_cli", "run" if degree > 1 else "train", "--config", str(cfg)]
    if degree > 1:
        cmd += ["--set", f"parallel_config.context_parallel={degree}"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-2000:] + res.stderr[-2000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "memory" in r]
    return {
        "peak_mib": max(r["memory"] for r in steps) / 2**20,
        "run_peak_mib": json.loads((out / "summary.json").read_text())["peak_memory_bytes"] / 2**20,
        "predicted_mib": _predicted(cfg, degree) / 2**20,
        # step 2: after the first step's warm-up (with one step, memory only)
        "tokens_per_sec": steps[-1]["tokens_per_sec"] if len(steps) > 1 else float("nan"),
        "loss": [r["loss"] for r in steps],
    }


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _data(root)
        results = {}
        for n in DEGREES:
            results[f"cp{n}"] = _run(root, n)
            print(f"cp{n}", json.dumps(results[f"cp{n}"]), file=sys.stderr, flush=True)  # as each run ends
    base = results[f"cp{DEGREES[0]}"]
    print(f"{SEQ} tokens, {LAYERS} layers, {STEPS} steps")
    print(
        "| context degree | step peak per rank (MiB) | vs cp1 | run peak (MiB) | plan (MiB) | plan error "
        "| tokens/s | vs cp1 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.2f}x | "
            f"{r['run_peak_mib']:.0f} | {r['predicted_mib']:.0f} | "
            f"{r['predicted_mib'] / r['run_peak_mib'] - 1:+.1%} | "
            f"{r['tokens_per_sec']:.0f} | {r['tokens_per_sec'] / base['tokens_per_sec']:.2f}x |"
        )
        np.testing.assert_allclose(r["loss"], base["loss"], rtol=1e-4)  # the same training
    return results


if __name__ == "__main__":
    main()
