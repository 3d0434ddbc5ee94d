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

With ``--shape 1.5b`` the model has Qwen2.5-1.5B's shape (28 layers, hidden 1536, MLP 8960, 12/2 heads,
vocab 151936, tied; LLaMA's layer, so no q/k/v biases), one sequence of 512 tokens a step (a fine-tuning
step's usual size: at 128 tokens the per-step dequantisation is a larger share of the step), and the modes
are ``lora``, ``qlora`` and, when BMTRAIN_REF_PYTHON names the reference venv, ``bnb-peft``: the same
checkpoint through transformers + PEFT with bitsandbytes' CPU nf4 matmul (bench_qlora_bnb.py).

``--shape 1.5b:8`` keeps the shape with 8 decoder layers (for a machine too slow or small for 28).

``--quantize-embedding`` adds the mode ``qlora-vocab``: nf4 layers as ``qlora``, and the tied embedding /
LM head in int8 with a scale per vocabulary row (``skip_modules: [norm, gate]``, quant/vocab.py). Every
mode's base bytes are also counted from the shape (and checked against the run's), so the ratios are
printed for the full layer count too.

``BENCH_QLORA_RECOMPUTE=1`` runs every mode with full recompute (``gradient_checkpointing: true``, the usual
QLoRA setting); run it without BMTRAIN_REF_PYTHON, as bitsandbytes' mode does not recompute.

Run: python benchmarks/bench_qlora.py [--shape 1.5b] [--quantize-embedding]   (or: python benchmarks/run_all.py qlora)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "135m": dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152, seq=256, batch=2, steps=4),
    "1.5b": dict(hidden=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, seq=512, batch=1, steps=3),
}
SHAPE = SHAPES["135m"]


def _shape(spec: str) -> dict:
    """A shape by name, ``NAME:LAYERS`` with fewer decoder layers (the same layer, embedding and head)."""
    name, _, layers = spec.partition(":")
    return {**SHAPES[name], **({"layers": int(layers)} if layers else {})}


WARMUP = 1
MODES = ("lora", "qlora", "qlora-reference")
LARGE_MODES = ("lora", "qlora")  # at 1.5b, plus bnb-peft with the reference venv


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
    if mode == "qlora-vocab":
        quant = QuantizationConfig(method="nf4", skip_modules=["norm", "gate"])
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
    if os.environ.get("BENCH_QLORA_RECOMPUTE"):
        model.enable_recompute("full")  # gradient checkpointing in every mode, as train_config sets it
    model.train()
    opt = build_optimizer(model, cfg, 1e-4)
    s = SHAPE
    rng = np.random.default_rng(0)
    batches = [paddle.to_tensor(rng.integers(0, s["vocab"], (s["batch"], s["seq"]))) for _ in range(2)]
    times, cpu, losses = [], [], []
    for i in range(s["steps"]):
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


def _run(mode: str, base: str, shape: str) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    s = _shape(shape)
    if mode == "bnb-peft":
        script = str(Path(__file__).with_name("bench_qlora_bnb.py"))
        args = [script, base, str(s["vocab"]), str(s["batch"]), str(s["seq"]), str(s["steps"])]
        cmd = [os.environ["BMTRAIN_REF_PYTHON"], *args]
    else:
        cmd = [sys.executable, __file__, "--child", mode, base, shape]
    out = subprocess.run(
        cmd,
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


def _counted_base(mode: str, layers: int) -> int:
    """A mode's base weight bytes counted from the shape: fp32 or nf4 (blocks of 64) projections, fp32
    norms, the tied embedding in fp32 or (qlora-vocab) int8 with a scale per row."""
    from bmtrain_cli.quant.formats import quantized_nbytes

    s = SHAPE
    h, f, v = s["hidden"], s["inter"], s["vocab"]
    kv = s["kv"] * (h // s["heads"])
    projections = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # (out, in)
    if mode.startswith("qlora"):
        layer = sum(quantized_nbytes("nf4", o, i, 64) for o, i in projections)
    else:
        layer = sum(o * i for o, i in projections) * 4
    embedding = quantized_nbytes("int8", v, h, h) if mode == "qlora-vocab" else v * h * 4
    return embedding + layers * (layer + 2 * h * 4) + h * 4


def main(shape: str = "135m", embedding: bool = False) -> dict:
    global SHAPE
    SHAPE = _shape(shape)
    large = not shape.startswith("135m")
    modes = LARGE_MODES if large else MODES
    if embedding:
        modes += ("qlora-vocab",)
    if large and os.environ.get("BMTRAIN_REF_PYTHON"):
        modes += ("bnb-peft",)
    with tempfile.TemporaryDirectory(prefix="bench-qlora-") as tmp:
        written = subprocess.run(  # in a child: the parent holds no fp32 model while the modes run
            [sys.executable, __file__, "--write", tmp, shape], capture_output=True, text=True, check=True
        )
        projection_bytes = int(written.stdout.strip().splitlines()[-1])
        runs = {}
        for mode in modes:
            runs[mode] = _run(mode, tmp, shape)
            print(f"{mode}: {json.dumps(runs[mode])}", flush=True)  # each as it ends (slow machines)
    mib = 2**20
    s = SHAPE
    print(
        f"model: {'Qwen2.5-1.5B' if large else 'SmolLM2-135M'} shape (hidden {s['hidden']}, "
        f"{s['layers']} layers, MLP {s['inter']}, vocab {s['vocab']}, tied), LoRA rank 8 on all projections, "
        f"batch {s['batch']} x seq {s['seq']}, fp32 AdamW, {s['steps'] - WARMUP} timed steps"
    )
    for r in runs.values():
        print(
            f"  {r['mode']:15s} base {r['base_bytes'] / mib:7.1f} MiB (quantised layers "
            f"{r.get('quantised_layer_bytes', 0) / mib:6.1f} MiB)  peak RSS {r['peak_rss_bytes'] / mib:7.1f} MiB  "
            f"load peak +{r.get('load_peak_growth_bytes', 0) / mib:6.1f} MiB  step {r['step_seconds']:6.2f} s "
            f"(CPU {r['step_cpu_seconds']:6.2f} s)  loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        )
    lora = runs["lora"]
    ratios = {}
    for mode in modes[1:]:
        r = runs[mode]
        ratios[mode] = {
            "base_memory": r["base_bytes"] / lora["base_bytes"],
            "quantised_layer_memory": r.get("quantised_layer_bytes", 0) / projection_bytes,
            "peak_rss": r["peak_rss_bytes"] / lora["peak_rss_bytes"],
            "load_peak": r.get("load_peak_growth_bytes", 0) / lora["load_peak_growth_bytes"],
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
    full = SHAPES[shape.partition(":")[0]]["layers"]
    for mode in modes:
        counted = _counted_base(mode, s["layers"]) if mode != "bnb-peft" else runs[mode]["base_bytes"]
        if counted != runs[mode]["base_bytes"]:
            raise RuntimeError(
                f"{mode}: counted {counted} base bytes, the run held {runs[mode]['base_bytes']}"
            )
    for mode in [m for m in modes[1:] if m != "bnb-peft"]:
        ratio = _counted_base(mode, full) / _counted_base("lora", full)
        ratios[mode]["base_memory_full_layers"] = ratio
        print(
            f"  {mode} / lora with all {full} layers (counted, equal to the run's bytes at {s['layers']}): "
            f"base {_counted_base(mode, full) / mib:.1f} MiB against {_counted_base('lora', full) / mib:.1f} MiB, "
            f"{ratio:.3f}x"
        )
    if "bnb-peft" in runs:
        ours, theirs = runs["qlora"], runs["bnb-peft"]
        print(
            f"  qlora / bnb-peft: speed {theirs['step_seconds'] / ours['step_seconds']:.3f}x (step "
            f"{ours['step_seconds']:.2f} s vs {theirs['step_seconds']:.2f} s), by CPU time "
            f"{theirs['step_cpu_seconds'] / ours['step_cpu_seconds']:.3f}x, peak RSS "
            f"{ours['peak_rss_bytes'] / theirs['peak_rss_bytes']:.3f}x"
        )
    return {"shape": SHAPE, "runs": runs, "ratios": ratios}


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--write":
        SHAPE = _shape(sys.argv[3])
        print(_write_base(sys.argv[2]))
    elif len(sys.argv) == 5 and sys.argv[1] == "--child":
        SHAPE = _shape(sys.argv[4])
        print(json.dumps(_child(sys.argv[2], sys.argv[3])))
    else:
        args = [a for a in sys.argv[1:] if a != "--quantize-embedding"]
        main(
            args[1] if len(args) == 2 and args[0] == "--shape" else "135m", "--quantize-embedding" in sys.argv
        )
