"""Training attention with and without a materialised mask: peak memory and tokens/s against sequence length.

One training step (forward, backward, AdamW) of a small LLaMA (2 layers, hidden 256, 4 heads / 2 KV heads,
ffn 688, vocab 2000, batch 1, fp32, reference ops) at seq 512, 2048 and 4096, each variant in a fresh
process so that its allocator peak is its own:

- mask:        the path before issue 16: the loader's segment ids reach the attention, which builds an
               additive [b, 1, s, s] bias from them and runs Paddle's sdpa with it
               (attention_implementation: sdpa, mask passed)
- sdpa_causal: no mask (right-padded rows), Paddle's sdpa with is_causal (its CPU path is a matmul +
               softmax composition that keeps the [b, heads, s, s] probabilities)
- blocked:     what training now runs on a CPU (attention_implementation: auto, no mask): the blocked
               kernel of models/attention.py, nothing s x s kept
- blocked_packed: the blocked kernel with the segment ids of a row packed with 4 samples

peak_MiB is the training peak as summary.json's peak_memory_bytes measures it (train.monitoring.metrics.MemoryMeter:
Paddle's host allocator peak since before the model was built). attention_MiB is the attention core alone:
the allocator peak of one forward + backward of the core on the layer's q/k/v shape, above its inputs.
Linear growth means ~8x from 512 to 4096 tokens; quadratic means ~64x.

    python benchmarks/run_all.py attention      (or python benchmarks/bench_attention.py)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

REPO = Path(__file__).resolve().parents[1]
SEQS = (512, 2048, 4096)
VARIANTS = ("mask", "sdpa_causal", "blocked", "blocked_packed")
SHAPE = dict(layers=2, hidden=256, heads=4, kv_heads=2, ffn=688, vocab=2000)
WARMUP, STEPS = 1, 2


def _worker(variant: str, seq: int) -> Dict[str, Any]:
    import numpy as np
    import paddle

    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.models.attention import attend
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter

    paddle.seed(0)
    meter = MemoryMeter(on_gpu=False)
    arch = ModelArch(
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["hidden"] // SHAPE["heads"],
        vocab_size=SHAPE["vocab"],
        max_position_embeddings=max(SEQS),
    )
    impl = "sdpa" if variant in ("mask", "sdpa_causal") else "auto"
    model = build(arch, kernels="reference", attention_implementation=impl)
    model.train()
    opt = paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters())
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, SHAPE["vocab"], (1, seq)), dtype="int64")
    segments = None
    if variant == "mask":
        segments = np.ones((1, seq), dtype="int64")  # one sample filling the row: what the loader passed
    elif variant == "blocked_packed":
        segments = np.repeat(np.arange(1, 5), seq // 4).reshape(1, seq)
    mask = None if segments is None else paddle.to_tensor(segments)
    times = []
    for i in range(WARMUP + STEPS):
        t0 = time.perf_counter()
        total, count = model.loss_sum(ids, ids, attention_mask=mask)
        (total / count).backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        float(total)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    peak = meter.peak()

    # the attention core alone, on this layer's shapes
    from paddle.base import core

    hd = SHAPE["hidden"] // SHAPE["heads"]
    q = paddle.randn([1, seq, SHAPE["heads"], hd])
    k, v = paddle.randn([1, seq, SHAPE["kv_heads"], hd]), paddle.randn([1, seq, SHAPE["kv_heads"], hd])
    for t in (q, k, v):
        t.stop_gradient = False
    base = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    attend(q, k, v, mask, impl, training=True).sum().backward()
    attention = core.host_memory_stat_peak_value("Allocated", 0) - base
    return {
        "peak_MiB": peak / 2**20,
        "attention_MiB": attention / 2**20,
        "step_s": statistics.median(times),
        "tokens_per_s": seq / statistics.median(times),
        "loss": float(total / count),
    }


def _run(variant: str, seq: int) -> Dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, __file__, "--worker", variant, str(seq)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=str(REPO))
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{variant} seq {seq} failed:\n{res.stderr[-2000:]}")


def main() -> Dict[str, Any]:
    rows: Dict[str, Dict[int, Dict[str, Any]]] = {v: {} for v in VARIANTS}
    for seq in SEQS:
        for variant in VARIANTS:
            rows[variant][seq] = _run(variant, seq)
    print(f"{'variant':<15} {'seq':>5} {'peak MiB':>9} {'attention MiB':>14} {'tokens/s':>9} {'loss':>8}")
    for variant in VARIANTS:
        for seq in SEQS:
            r = rows[variant][seq]
            print(
                f"{variant:<15} {seq:>5} {r['peak_MiB']:>9.1f} {r['attention_MiB']:>14.1f} "
                f"{r['tokens_per_s']:>9.0f} {r['loss']:>8.4f}"
            )
    lo, hi = SEQS[0], SEQS[-1]
    growth = {
        v: {
            "attention": rows[v][hi]["attention_MiB"] / rows[v][lo]["attention_MiB"],
            "peak": rows[v][hi]["peak_MiB"] / rows[v][lo]["peak_MiB"],
        }
        for v in VARIANTS
    }
    print(
        f"\ngrowth from seq {lo} to {hi} ({hi // lo}x tokens; linear = {hi // lo}x, quadratic = {(hi // lo) ** 2}x):"
    )
    for v, g in growth.items():
        print(f"  {v:<15} attention {g['attention']:5.1f}x   training peak {g['peak']:5.1f}x")
    for seq in SEQS:
        m, b = rows["mask"][seq], rows["blocked"][seq]
        print(
            f"  seq {seq}: blocked / mask  peak {b['peak_MiB'] / m['peak_MiB']:.2f}x, "
            f"tokens/s {b['tokens_per_s'] / m['tokens_per_s']:.2f}x"
        )
    return {"rows": rows, "growth": growth}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(_worker(sys.argv[2], int(sys.argv[3]))), flush=True)
    else:
        main()
