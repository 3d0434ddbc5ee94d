"""Context parallel: per-rank peak tensor memory and throughput of a training step against the context degree.

One process (`bmtrain train`, the baseline) and `bmtrain run` with context_parallel 2 and 4, on rows of
BENCH_CP_SEQ tokens (default 8192, one long sample per row; 16384 took ~4 min a step on the 2-core machine)
through a model of SmolLM2-135M's width (hidden 576, intermediate 1536, 9 heads, 3 KV heads, tied
embeddings) with BENCH_CP_LAYERS decoder layers (default 2 of its 30: the 2-core machine cannot run the
whole depth at this length), 2 optimizer steps of one row. Memory is rank 0's peak of live Paddle tensors
(metrics.jsonl ``memory``; every rank holds the same number of tokens); throughput is tokens per second of
the whole group. All three runs share the same machine in one session: compare ratios, not absolute figures.
"""

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
  max_steps: 2
  micro_batch_size: 1
  global_batch_size: 1
  warmup_steps: 0
  logging_steps: 1
  save_steps: 1000
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


def _run(root: Path, degree: int) -> dict:
    out = root / f"cp{degree}"
    cfg = root / f"cp{degree}.yaml"
    cfg.write_text(CONFIG.format(layers=LAYERS, seq=SEQ, tok=root / "tok", data=root / "long.jsonl", out=out))
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
        "tokens_per_sec": steps[-1]["tokens_per_sec"],  # step 2: after the first step's warm-up
        "loss": [r["loss"] for r in steps],
    }


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _data(root)
        results = {f"cp{n}": _run(root, n) for n in (1, 2, 4)}
    base = results["cp1"]
    print(
        f"| context degree | peak tensor memory per rank (MiB) | vs cp1 | tokens/s | vs cp1 |  ({SEQ} tokens, {LAYERS} layers)"
    )
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['peak_mib']:.0f} | {r['peak_mib'] / base['peak_mib']:.2f}x | "
            f"{r['tokens_per_sec']:.0f} | {r['tokens_per_sec'] / base['tokens_per_sec']:.2f}x |"
        )
        np.testing.assert_allclose(r["loss"], base["loss"], rtol=1e-4)  # the same training
    return results


if __name__ == "__main__":
    main()
