"""Context parallel: per-rank peak tensor memory and throughput of a training step against the context degree.

One process (`bmtrain train`, the baseline) and `bmtrain run` with context_parallel 2 and 4 (BENCH_CP_DEGREES,
default 1,2,4), on rows of BENCH_CP_SEQ tokens (default 8192, one long sample per row) through a model of
SmolLM2-135M's width (hidden 576, intermediate 1536, 9 heads, 3 KV heads, tied embeddings) with
BENCH_CP_LAYERS decoder layers (default 2 of its 30: the 2-core machine cannot run the whole depth at this
length), BENCH_CP_STEPS optimizer steps of one row (default 2; throughput needs 2, step 1 warms up).
Memory is rank 0's peak of live Paddle tensors over the steps (metrics.jsonl ``memory``; every rank holds
the same number of tokens), beside the whole run's (summary.json ``peak_memory_bytes``) and what
`bmtrain plan --device cpu` predicts for it; throughput is tokens per second of the whole group. All runs
share the same machine in one session: compare ratios, not absolute figures.

BENCH_CP_RING=1 measures the ring attention alone instead: over BENCH_CP_DEGREES' largest degree of ranks
(``paddle.distributed.launch``), one attention layer of the model's shape (9 query heads, 3 KV heads,
head_dim 64, fp32) on a row of BENCH_CP_SEQ tokens, forward and backward of parallel/ring_attention.py's
RingCore with the fused CPU kernel per chunk pair and with Paddle-op blocks, alternating in the same
processes (BENCH_CP_STEPS timed steps each after a warm-up): the median of the slowest rank's step time of
each, their ratio, and rank 0's peak of live Paddle tensors during a step of each. BENCH_CP_SOFTCAP=50 caps
the scores as Gemma 2's attn_logit_softcapping does (cap * tanh(s / cap) before the mask, in both paths)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

SEQ = int(os.environ.get("BENCH_CP_SEQ", "8192"))
LAYERS = int(os.environ.get("BENCH_CP_LAYERS", "2"))
STEPS = int(os.environ.get("BENCH_CP_STEPS", "2"))
DEGREES = [int(x) for x in os.environ.get("BENCH_CP_DEGREES", "1,2,4").split(",")]
SOFTCAP = float(os.environ.get("BENCH_CP_SOFTCAP", "0")) or None  # the ring benchmark's score cap
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


def _ring_step(core: Any, tensors: List[Any], w: Any) -> float:
    from bmtrain_cli.models.attention_choice import ScoreRule

    for t in tensors:
        t.clear_gradient()
    start = time.perf_counter()
    out = core(*tensors, None, rule=ScoreRule(None, SOFTCAP))
    (out * w).sum().backward()
    return time.perf_counter() - start


def _ring_worker(report: str) -> None:
    """One rank of the ring benchmark (see the module docstring); rank 0 writes ``report`` (json)."""
    import paddle
    import paddle.distributed as dist

    from bmtrain_cli.parallel import cpu_compat
    from bmtrain_cli.parallel.ring_attention import Ring, RingCore, local_indices
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter

    cpu_compat.apply_if_cpu()
    dist.init_parallel_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    dist.barrier()
    rng = np.random.default_rng(0)
    idx = local_indices(SEQ, world, rank)
    shapes = [(1, SEQ, 9, 64), (1, SEQ, 3, 64), (1, SEQ, 3, 64)]
    tensors = [paddle.to_tensor(rng.standard_normal(s).astype("float32")[:, idx]) for s in shapes]
    for t in tensors:
        t.stop_gradient = False
    w = paddle.to_tensor(rng.standard_normal((1, len(idx), 9, 64)).astype("float32"))
    ring = Ring(group, list(range(world)), rank)
    cores = {name: RingCore(ring, fused=name == "fused") for name in ("fused", "blocks")}
    result: Dict[str, Any] = {}
    for name, core in cores.items():  # warm-up, and each path's peak of live tensors in a step
        meter = MemoryMeter(on_gpu=False)
        _ring_step(core, tensors, w)
        result[f"{name}_peak_mib"] = meter.peak() / 2**20
    times: Dict[str, List[float]] = {name: [] for name in cores}
    for _ in range(STEPS):
        for name, core in cores.items():
            t = paddle.to_tensor([_ring_step(core, tensors, w)], dtype="float64")
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's step
            times[name].append(float(t.item()))
    if rank == 0:
        result.update({f"{name}_s": float(np.median(v)) for name, v in times.items()})
        Path(report).write_text(json.dumps(result))


def ring_main() -> Dict[str, Any]:
    degree = max(DEGREES)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "ring.json"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(degree)]
        cmd += ["--log_dir", str(Path(tmp) / "log"), __file__, "--ring-worker", str(report)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            logs = "".join(p.read_text()[-2000:] for p in sorted((Path(tmp) / "log").glob("workerlog.*")))
            raise RuntimeError(logs)
        r = json.loads(report.read_text())
    cap = f", scores capped at {SOFTCAP:g}" if SOFTCAP else ""
    print(f"ring attention, cp{degree}, {SEQ} tokens (9/3 heads, head_dim 64, fp32{cap}), {STEPS} steps")
    print("| per chunk pair | step (s, slowest rank) | vs Paddle-op blocks | peak per rank (MiB) |")
    print("|---|---|---|---|")
    for name, label in (("blocks", "Paddle-op blocks"), ("fused", "fused CPU kernel")):
        secs, peak = r[name + "_s"], r[name + "_peak_mib"]
        print(f"| {label} | {secs:.2f} | {secs / r['blocks_s']:.2f}x | {peak:.0f} |")
    return r


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
    if len(sys.argv) > 2 and sys.argv[1] == "--ring-worker":
        _ring_worker(sys.argv[2])
    elif os.environ.get("BENCH_CP_RING") == "1":
        ring_main()
    else:
        main()
