"""QLoRA (LoRA on an nf4-quantised base) vs LoRA on the fp32 base, on a SmolLM2-135M-shaped model, measured
in one run: base weight memory, peak RSS of the training steps, step time.

A random model of SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, 9/3 heads, vocab 49152, tied) is
written once as an fp32 checkpoint; each mode then loads it in its own child process the way `bmtrain
train` does (QLoRA: quantised tensor by tensor while read, models/hf.py) and trains rank-8 adapters on
every linear projection with AdamW on the same random batches. Modes: ``lora`` (fp32 base), ``qlora``
(nf4, blocks of 64, the custom kernels: C++ dequantised tiles times Paddle's matmul) and
``qlora-reference`` (nf4, each layer's weight dequantised whole in Paddle ops, then one matmul).

* base weight memory: the bytes the base's weights take (quantised layers: codes + scales; the embedding
  and norms stay fp32), whole and for the quantised layers alone;
* peak RSS: the process's peak resident set over the timed steps (VmHWM, reset before them), so it holds
  the loaded base, the adapters, the optimizer state and a step's activations;
* loading's peak: how far the process's peak resident set grew while the checkpoint was loaded (from
  the resident set just before, VmHWM reset then);
* step time: the mean of the timed steps (forward, backward, AdamW), wall clock and the process's CPU
  time (all threads; less sensitive to other work on a shared machine).

Run: python benchmarks/bench_qlora.py   (or: python benchmarks/run_all.py qlora)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPE = dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152, seq=256, batch=2)
STEPS, WARMUP = 4, 1
MODES = ("lora", "qlora", "qlora-reference")


def _arch():
    from bmtrain_cli.models.arch import ModelArch

    s = SHAPE
    return ModelArch(
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        head_dim=s["hidden"] // s["heads"],
        vocab_size=s["vocab"],
        tie_word_embeddings=True,
    )


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def _child(mode: str, base: str) -> dict:
    import time

    import numpy as np
    import paddle

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bmtrain_cli.config.schema import QuantizationConfig, TrainConfig
    from bmtrain_cli.lora import apply_lora
    from bmtrain_cli.models import load_pretrained
    from bmtrain_cli.plan import host_memory
    from bmtrain_cli.quant.layer import quantized_bytes, quantized_layers
    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    host_memory.apply("release")
    quant = QuantizationConfig(method="nf4") if mode.startswith("qlora") else None
    kernels = "reference" if mode == "qlora-reference" else "auto"
    paddle.zeros([8, 8]).numpy()  # the allocator's first arena, before the baseline
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status("VmRSS")
    model = load_pretrained(base, kernels=kernels, quantization=quant)
    load_peak = _status("VmHWM") - before
    fp32_params = sum(int(p.numel()) * 4 for p in model.parameters())
    quantised = [m for _, m in quantized_layers(model)]
    cfg = TrainConfig(finetuning="lora", lora_rank=8, lora_alpha=16, lora_target_modules="all-linear")
    apply_lora(model, cfg)
    model.train()
    opt = build_optimizer(model, cfg, 1e-4)
    s = SHAPE
    rng = np.random.default_rng(0)
    batches = [paddle.to_tensor(rng.integers(0, s["vocab"], (s["batch"], s["seq"]))) for _ in range(2)]
    times, cpu, losses = [], [], []
    for i in range(STEPS):
        if i == WARMUP:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # the peak (VmHWM) restarts from the current RSS
        ids = batches[i % 2]
        t0, c0 = time.perf_counter(), time.process_time()
        loss, count = model.loss_sum(ids, ids)
        (loss / count).backward()
        opt.step()
        opt.clear_grad(set_to_zero=False)
        losses.append(float(loss / count))
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    quant_bytes = quantized_bytes(model)
    return {
        "mode": mode,
        "quantised_layers": len(quantised),
        "impl": sorted({m.impl for m in quantised}),
        "base_bytes": fp32_params + quant_bytes,
        "quantised_layer_bytes": quant_bytes,
        "peak_rss_bytes": _status("VmHWM"),
        "load_peak_growth_bytes": load_peak,
        "step_seconds": sum(times) / len(times),
        "step_cpu_seconds": sum(cpu) / len(cpu),
        "losses": losses,
    }


def _run(mode: str, base: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, base],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _write_base(path: str) -> int:
    """The random fp32 base checkpoint; returns the bytes of its projection weights (the quantised ones)."""
    import paddle

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bmtrain_cli.models import build, save_pretrained

    paddle.seed(0)
    model = build(_arch(), kernels="reference")
    save_pretrained(model, path)
    return sum(
        int(p.numel()) * 4 for n, p in model.named_parameters() if n.endswith("_proj.weight") and p.ndim == 2
    )


def main() -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-qlora-") as tmp:
        projection_bytes = _write_base(tmp)
        runs = {mode: _run(mode, tmp) for mode in MODES}
    mib = 2**20
    s = SHAPE
    print(
        f"model: SmolLM2-135M shape (hidden {s['hidden']}, {s['layers']} layers, MLP {s['inter']}, vocab "
        f"{s['vocab']}, tied), LoRA rank 8 on all projections, batch {s['batch']} x seq {s['seq']}, "
        f"fp32 AdamW, {STEPS - WARMUP} timed steps"
    )
    for r in runs.values():
        print(
            f"  {r['mode']:15s} base {r['base_bytes'] / mib:7.1f} MiB (quantised layers "
            f"{r['quantised_layer_bytes'] / mib:6.1f} MiB)  peak RSS {r['peak_rss_bytes'] / mib:7.1f} MiB  "
            f"load peak +{r['load_peak_growth_bytes'] / mib:6.1f} MiB  step {r['step_seconds']:6.2f} s (CPU {r['step_cpu_seconds']:6.2f} s)  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        )
    lora = runs["lora"]
    ratios = {}
    for mode in MODES[1:]:
        r = runs[mode]
        ratios[mode] = {
            "base_memory": r["base_bytes"] / lora["base_bytes"],
            "quantised_layer_memory": r["quantised_layer_bytes"] / projection_bytes,
            "peak_rss": r["peak_rss_bytes"] / lora["peak_rss_bytes"],
            "load_peak": r["load_peak_growth_bytes"] / lora["load_peak_growth_bytes"],
            "speed": lora["step_seconds"] / r["step_seconds"],
            "cpu_speed": lora["step_cpu_seconds"] / r["step_cpu_seconds"],
        }
        q = ratios[mode]
        print(
            f"  {mode} / lora: base weights {q['base_memory']:.3f}x (quantised layers "
            f"{q['quantised_layer_memory']:.3f}x), peak RSS {q['peak_rss']:.3f}x, loading's peak "
            f"{q['load_peak']:.3f}x, speed "
            f"{q['speed']:.3f}x (step time {1 / q['speed']:.3f}x), by CPU time {q['cpu_speed']:.3f}x"
        )
    return {"shape": SHAPE, "runs": runs, "ratios": ratios}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], sys.argv[3])))
    else:
        main()
