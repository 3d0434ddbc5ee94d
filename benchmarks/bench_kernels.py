"""Custom kernels against the pure-Paddle reference, in one run: forward+backward time and peak memory.

- rms_norm [8192, 1024], rotary q/k [4, 1024, 16, 64], swiglu [8192, 2816]: fp32, forward + backward.
- linear_cross_entropy: 8192 tokens, hidden 512, vocab 32000 (the issue's shape), loss + gradients of the
  hidden states and the weight; the reference materialises the [tokens, vocab] logits.
- train_step: a tiny decoder (4 layers, hidden 256, vocab 8000, seq 256, batch 8) forward + backward +
  AdamW, kernels custom vs reference (same weights and batch; their first losses are printed).

The measurements run in a worker process with glibc's mmap/trim thresholds raised
(MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_), so freed blocks are reused instead of returned to the OS:
on the VMs this was measured on, first-touch page faults cost about 3 ns/byte (paddle.ones_like of 23 MB:
68 ms, 0.6 ms with reuse) and would otherwise dominate every op, ours and the reference alike. Pass
--system-malloc to measure without it.

Peak memory is Paddle's host allocator peak during the measured call minus what was allocated before it
(inputs and weights), i.e. the memory the computation itself needs. Times are medians. Threads follow
OMP_NUM_THREADS (`make bench` sets 2).

Run: `python benchmarks/run_all.py kernels` or `python benchmarks/bench_kernels.py [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _measure(fn: Callable[[], object], repeats: int) -> Dict[str, float]:
    import paddle.base.core as core

    fn()  # warm-up (and first-call allocations)
    times: List[float] = []
    peaks: List[int] = []
    for _ in range(repeats):
        base = core.host_memory_stat_current_value("Allocated", 0)
        core.host_memory_stat_reset_peak_value("Allocated", 0)
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        peaks.append(core.host_memory_stat_peak_value("Allocated", 0) - base)
        del out
    return {"time_s": statistics.median(times), "peak_bytes": int(max(peaks))}


def _fwd_bwd(op: Callable, inputs: list, grad_inputs: list) -> Callable[[], object]:
    import paddle

    def run():
        outs = op(*inputs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        loss = outs[0] if outs[0].ndim == 0 else None
        if loss is not None:
            return paddle.grad([loss], grad_inputs)
        ups = [paddle.ones_like(o) for o in outs]
        return paddle.grad(outs, grad_inputs, ups)

    return run


def _param(shape, scale=1.0, seed=0, grad=True):
    import numpy as np
    import paddle

    t = paddle.to_tensor((np.random.default_rng(seed).standard_normal(shape) * scale).astype("float32"))
    t.stop_gradient = not grad
    return t


def bench_ops(quick: bool) -> Dict[str, Dict[str, float]]:
    import numpy as np
    import paddle

    from bmtrain_cli.ops import custom, reference

    repeats = 3 if quick else 7
    tokens = 2048 if quick else 8192
    cases = {}
    x, w = _param([tokens, 1024]), _param([1024], seed=1)
    cases["rms_norm"] = (lambda o: lambda a, b: o.rms_norm(a, b, 1e-6), [x, w], [x, w])
    b = 1 if quick else 4
    q, k = _param([b, 1024, 16, 64]), _param([b, 1024, 16, 64], seed=1)
    ang = np.random.default_rng(2).standard_normal([1, 1024, 32]).astype("float32")
    ang = np.concatenate([ang, ang], axis=-1)
    cos, sin = paddle.to_tensor(np.cos(ang)), paddle.to_tensor(np.sin(ang))
    cases["rotary"] = (lambda o: lambda a, c: o.rotary(a, c, cos, sin), [q, k], [q, k])
    g, u = _param([tokens, 2816], 3.0), _param([tokens, 2816], seed=1)
    cases["swiglu"] = (lambda o: o.swiglu, [g, u], [g, u])

    results: Dict[str, Dict[str, float]] = {}
    for name, (pick, inputs, grads) in cases.items():
        ref = _measure(_fwd_bwd(pick(reference), inputs, grads), repeats)
        ours = _measure(_fwd_bwd(pick(custom), inputs, grads), repeats)
        results[name] = _row(name, ref, ours)
    return results


def bench_linear_ce(quick: bool) -> Dict[str, float]:
    import numpy as np
    import paddle

    from bmtrain_cli.ops import custom, reference

    n, hid, vocab = (2048, 256, 32000) if quick else (8192, 256, 32000)
    h = _param([n, hid])
    w = _param([hid, vocab], 1 / np.sqrt(hid), seed=1)
    lab = np.random.default_rng(3).integers(0, vocab, n)
    lab[::7] = -100
    labels = paddle.to_tensor(lab)
    repeats = 2
    ref = _measure(
        _fwd_bwd(lambda a, b: reference.linear_cross_entropy(a, b, labels), [h, w], [h, w]), repeats
    )
    ours = _measure(_fwd_bwd(lambda a, b: custom.linear_cross_entropy(a, b, labels), [h, w], [h, w]), repeats)
    row = _row(f"linear_cross_entropy n={n} h={hid} v={vocab}", ref, ours)
    row["logits_bytes"] = n * vocab * 4
    return row


def _row(name: str, ref: Dict[str, float], ours: Dict[str, float]) -> Dict[str, float]:
    row = {
        "ref_ms": ref["time_s"] * 1e3,
        "custom_ms": ours["time_s"] * 1e3,
        "speedup": ref["time_s"] / ours["time_s"],
        "ref_peak_mib": ref["peak_bytes"] / 2**20,
        "custom_peak_mib": ours["peak_bytes"] / 2**20,
        "peak_ratio": ours["peak_bytes"] / max(ref["peak_bytes"], 1),
    }
    print(
        f"{name:42s} ref {row['ref_ms']:9.1f} ms  custom {row['custom_ms']:9.1f} ms  speedup {row['speedup']:5.2f}x"
        f"  | peak ref {row['ref_peak_mib']:8.1f} MiB  custom {row['custom_peak_mib']:8.1f} MiB"
        f"  ratio {row['peak_ratio']:.3f}",
        flush=True,
    )
    return row


def _time_models(arch, ids, repeats: int) -> Dict[str, Dict[str, float]]:
    """Steps of the two models interleaved (ref, custom, ref, ...) so that load changes hit both alike."""
    import paddle
    import paddle.base.core as core

    from bmtrain_cli.models import build

    models = {}
    for mode in ("reference", "custom"):
        paddle.seed(0)
        model = build(arch, kernels=mode)
        models[mode] = (model, paddle.optimizer.AdamW(learning_rate=1e-4, parameters=model.parameters()))
    stats: Dict[str, Dict[str, list]] = {m: {"t": [], "peak": [], "loss": []} for m in models}
    for i in range(repeats + 1):
        for mode, (model, opt) in models.items():
            base = core.host_memory_stat_current_value("Allocated", 0)
            core.host_memory_stat_reset_peak_value("Allocated", 0)
            t0 = time.perf_counter()
            s, c = model.loss_sum(ids, ids)
            (s / c).backward()
            opt.step()
            opt.clear_grad()
            loss = float(s / c)
            if i > 0:  # the first step is a warm-up
                stats[mode]["t"].append(time.perf_counter() - t0)
                stats[mode]["peak"].append(core.host_memory_stat_peak_value("Allocated", 0) - base)
            stats[mode]["loss"].append(loss)
    return {
        m: {"time_s": statistics.median(v["t"]), "peak_bytes": max(v["peak"]), "first_loss": v["loss"][0]}
        for m, v in stats.items()
    }


def bench_train_step(quick: bool) -> Dict[str, float]:
    import numpy as np
    import paddle

    from bmtrain_cli.models.arch import ModelArch

    shape = dict(layers=4, hidden=256, heads=4, ffn=688, vocab=8000, seq=256, batch=8)
    if quick:
        shape.update(layers=2, seq=128, batch=4)
    arch = ModelArch(
        family="llama",
        hidden_size=shape["hidden"],
        intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        vocab_size=shape["vocab"],
        max_position_embeddings=shape["seq"],
    )
    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(0, shape["vocab"], (shape["batch"], shape["seq"])), dtype="int64")
    out: Dict[str, float] = {}
    for mode, m in _time_models(arch, ids, 3 if quick else 6).items():
        out[f"{mode}_step_ms"] = m["time_s"] * 1e3
        out[f"{mode}_peak_mib"] = m["peak_bytes"] / 2**20
        out[f"{mode}_first_loss"] = m["first_loss"]
    tokens = shape["batch"] * shape["seq"]
    out["speedup"] = out["reference_step_ms"] / out["custom_step_ms"]
    out["custom_tokens_per_sec"] = tokens / out["custom_step_ms"] * 1e3
    out["reference_tokens_per_sec"] = tokens / out["reference_step_ms"] * 1e3
    print(
        f"train step {shape}: reference {out['reference_step_ms']:.1f} ms ({out['reference_tokens_per_sec']:.0f} tok/s)"
        f", custom {out['custom_step_ms']:.1f} ms ({out['custom_tokens_per_sec']:.0f} tok/s)"
        f", speedup {out['speedup']:.2f}x; peak ref {out['reference_peak_mib']:.0f} MiB, custom"
        f" {out['custom_peak_mib']:.0f} MiB; first loss ref {out['reference_first_loss']:.6f}"
        f" custom {out['custom_first_loss']:.6f}",
        flush=True,
    )
    return out


MALLOC_REUSE = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 36)}


def _work(quick: bool) -> dict:
    import paddle

    from bmtrain_cli.ops.build import load_extension

    load_extension()
    print(
        f"paddle {paddle.__version__}, device {paddle.get_device()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
        f", malloc reuse: {'MALLOC_MMAP_THRESHOLD_' in os.environ}",
        flush=True,
    )
    results = {"ops": bench_ops(quick)}
    results["linear_cross_entropy"] = bench_linear_ce(quick)
    results["train_step"] = bench_train_step(quick)
    return results


def main(argv: List[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="custom kernels vs reference")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (a smoke run)")
    parser.add_argument("--system-malloc", action="store_true", help="do not raise glibc's malloc thresholds")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv if argv is not None else [])
    if args.worker or args.system_malloc:
        results = _work(args.quick)
        if args.worker:
            print("RESULT " + json.dumps(results), flush=True)
        return results
    env = dict(os.environ, **MALLOC_REUSE)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker"] + (["--quick"] if args.quick else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    results: dict = {}
    for line in proc.stdout:
        if line.startswith("RESULT "):
            results = json.loads(line[len("RESULT ") :])
        else:
            print(line, end="", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"benchmark worker failed with exit code {proc.returncode}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
