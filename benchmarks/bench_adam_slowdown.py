"""The slowdown after the first Adam/AdamW step on the CPU build, and CpuAdamW's fix.

For each optimizer: the process CPU time of a 384x576 @ 576x1536 matmul (on a tensor no optimizer
touches) before and after one optimizer step of a Linear(576, 1536). Run with OMP_NUM_THREADS=2:

    OMP_NUM_THREADS=2 python benchmarks/bench_adam_slowdown.py

Each optimizer runs in its own process (the slowdown is process-wide and does not go away), twice: with
MKL's own CPU dispatch (``MKL_DEBUG_CPU_TYPE`` empty: its SSE code on an AMD CPU) and with
``MKL_DEBUG_CPU_TYPE=5`` (its AVX2 code; what ``import bmtrain_cli`` sets on AMD CPUs, bmtrain_cli/cpu_env.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

CHILD = """
import sys, time, paddle
paddle.set_device("cpu")
from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW
x, w = paddle.randn([384, 576]), paddle.randn([576, 1536])
def matmul_ms():
    for _ in range(3): paddle.matmul(x, w)
    t = time.process_time()
    for _ in range(30): paddle.matmul(x, w)
    return (time.process_time() - t) / 30 * 1e3
lin = paddle.nn.Linear(576, 1536)
cls = {"paddle AdamW": paddle.optimizer.AdamW, "paddle Adam": paddle.optimizer.Adam,
       "paddle SGD": paddle.optimizer.SGD, "CpuAdamW elementwise": CpuAdamW,
       "CpuAdamW fused": CpuAdamW}[sys.argv[1]]
extra = {"CpuAdamW elementwise": {"fused": False}, "CpuAdamW fused": {"fused": True}}.get(sys.argv[1], {})
opt = cls(learning_rate=1e-3, parameters=lin.parameters(), **extra)
lin(x).mean().backward()
before = matmul_ms()
opt.step()
print(f"{before:.1f} {matmul_ms():.1f}")
"""


def main() -> dict:
    results = {}
    print("| MKL_DEBUG_CPU_TYPE | optimizer | matmul CPU ms before its first step | after | ratio |")
    print("|---|---|---|---|---|")
    for mkl in ("", "5"):
        env = dict(os.environ, MKL_DEBUG_CPU_TYPE=mkl)
        for name in ("paddle SGD", "paddle Adam", "paddle AdamW", "CpuAdamW elementwise", "CpuAdamW fused"):
            t0 = time.time()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, name], capture_output=True, text=True, check=True, env=env
            )
            before, after = map(float, out.stdout.split())
            results[f"{name} MKL_DEBUG_CPU_TYPE={mkl}"] = {"before_ms": before, "after_ms": after}
            print(
                f"| {mkl or '(unset)'} | {name} | {before:.1f} | {after:.1f} | {after / before:.2f}x | "
                f"({time.time() - t0:.0f}s)",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
