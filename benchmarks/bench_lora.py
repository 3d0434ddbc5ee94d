"""LoRA vs full fine-tuning on the same model and data, measured in one run: peak memory and tokens/s.

Each mode trains in its own child process (so that the peaks are per mode): the same LLaMA-style decoder,
the same random token batches, AdamW, fp32, CPU. Peak memory is measured as the trainer measures
peak_memory_bytes (bmtrain_cli.train.monitoring.metrics.MemoryMeter: on CPU the peak of Paddle's host allocator
since the model build started, on a GPU max_memory_allocated); the process's RSS growth is reported
beside it. LoRA: rank 8 on all linear projections of the decoder layers.

Run: python benchmarks/bench_lora.py   (or: python benchmarks/run_all.py lora)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SHAPE = dict(hidden=512, inter=1376, layers=4, heads=8, kv=8, vocab=8000, seq=256, batch=4)
STEPS, WARMUP = 6, 2


def _child(mode: str) -> dict:
    import time

    import numpy as np
    import paddle

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bmtrain_cli.config.schema import TrainConfig
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.models.decoder import CausalLM
    from bmtrain_cli.plan import host_memory
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter
    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    host_memory.apply("release")  # RSS ~= the live tensors (train_config.host_memory: release)
    meter = MemoryMeter(on_gpu=False)
    s = SHAPE
    arch = ModelArch(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=s["hidden"] // s["heads"],
        vocab_size=s["vocab"],
    )
    paddle.seed(0)
    model = CausalLM(arch, kernels="auto")
    model.init_weights()
    cfg = TrainConfig(finetuning=mode, lora_rank=8, lora_alpha=16, lora_target_modules="all-linear")
    if mode == "lora":
        from bmtrain_cli.lora import apply_lora

        apply_lora(model, cfg)
    model.train()
    opt = build_optimizer(model, cfg, 1e-4)
    trainable = sum(int(p.numel()) for p in model.parameters() if not p.stop_gradient)
    total = sum(int(p.numel()) for p in model.parameters())
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, s["vocab"], (s["batch"], s["seq"])))
    times, losses = [], []
    for i in range(STEPS):
        t0 = time.perf_counter()
        loss, count = model.loss_sum(ids, ids)
        (loss / count).backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        losses.append(float(loss / count))
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    tokens = s["batch"] * s["seq"]
    return {
        "mode": mode,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "peak_memory_bytes": meter.peak(),
        "peak_rss_bytes": meter.peak_rss(),
        "tokens_per_sec": tokens * len(times) / sum(times),
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def _run(mode: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode], capture_output=True, text=True, env=env, timeout=1800
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> dict:
    full, lora = _run("full"), _run("lora")
    mib = 2**20
    print(
        f"model: hidden {SHAPE['hidden']}, {SHAPE['layers']} layers, vocab {SHAPE['vocab']}, "
        f"batch {SHAPE['batch']} x seq {SHAPE['seq']}, fp32 AdamW, {STEPS - WARMUP} timed steps"
    )
    for r in (full, lora):
        print(
            f"  {r['mode']:5s} trainable {r['trainable_parameters']:>11,} of {r['total_parameters']:,}  "
            f"peak memory {r['peak_memory_bytes'] / mib:8.1f} MiB (process {r['peak_rss_bytes'] / mib:.1f} MiB)  "
            f"{r['tokens_per_sec']:8.0f} tokens/s"
        )
    ratio_mem = lora["peak_memory_bytes"] / full["peak_memory_bytes"]
    ratio_tps = lora["tokens_per_sec"] / full["tokens_per_sec"]
    print(f"  LoRA / full: peak memory {ratio_mem:.3f}x, tokens/s {ratio_tps:.3f}x")
    return {
        "shape": SHAPE,
        "full": full,
        "lora": lora,
        "memory_ratio": ratio_mem,
        "tokens_per_sec_ratio": ratio_tps,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2])))
    else:
        main()
