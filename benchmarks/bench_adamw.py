"""The AdamW update alone on the SmolLM2-135M parameter shapes: Paddle's AdamW, CpuAdamW with the
elementwise Paddle ops, and CpuAdamW with the fused C++ kernel (kernels/cpu/adamw_cpu.cc).

Parameters: a LLaMA built by bmtrain_cli.models.build with the SmolLM2-135M shape (30 layers, hidden 576,
9 / 3 heads, intermediate 1536, vocab 49152, tied: 134.5M parameters), fixed random gradients. Each
optimizer runs in its own process (Paddle's AdamW slows the rest of its process, see
bench_adam_slowdown.py), rounds alternate the three, and a step is timed by wall clock and by process CPU
time (the CPU time holds better on a shared machine). Run with OMP_NUM_THREADS=2:

    OMP_NUM_THREADS=2 python benchmarks/bench_adamw.py [--rounds 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KINDS = ("paddle AdamW", "CpuAdamW elementwise", "CpuAdamW fused")
STEPS = 5


def _worker(kind: str) -> dict:
    import paddle

    sys.path.insert(0, str(REPO))
    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.train.cpu_adamw import CpuAdamW

    paddle.seed(0)
    arch = ModelArch(
        family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    params = [p for p in build(arch, kernels="reference").parameters() if not p.stop_gradient]
    for p in params:
        p.grad = paddle.randn(p.shape, dtype=p.dtype) * 1e-3
    kw = dict(learning_rate=3e-4, parameters=params, weight_decay=0.01)
    opt = {
        "paddle AdamW": lambda: paddle.optimizer.AdamW(**kw),
        "CpuAdamW elementwise": lambda: CpuAdamW(fused=False, **kw),
        "CpuAdamW fused": lambda: CpuAdamW(fused=True, **kw),
    }[kind]()
    opt.step()  # creates the moments
    wall, cpu = [], []
    for _ in range(STEPS):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"n_params": sum(p.size for p in params), "wall_s": statistics.median(wall),
            "cpu_s": statistics.median(cpu)}  # fmt: skip


def main(rounds: int = 2) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "2")
    runs: dict = {k: [] for k in KINDS}
    for _ in range(rounds):
        for kind in KINDS:
            out = subprocess.run(
                [sys.executable, __file__, "--worker", kind],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, {runs[KINDS[0]][0]['n_params']:,} parameters, "
          f"median of {STEPS} steps, best of {rounds} rounds")  # fmt: skip
    print("| update | wall s/step | CPU s/step | wall vs paddle AdamW |\n|---|---|---|---|")
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    base = best["paddle AdamW"]["wall_s"]
    for kind, r in best.items():
        print(f"| {kind} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['wall_s'] / base:.2f}x |")
    return {k: {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "all": runs[k]} for k, r in best.items()}


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--worker":
        print(json.dumps(_worker(sys.argv[2])), flush=True)
    else:
        main(int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2)
