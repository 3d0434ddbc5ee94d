"""The gated delta rule (Gated DeltaNet) alone: forward + backward of our CPU kernel (ops/delta_rule.py)
against the Paddle-op chunked rule (ops/reference.py), fp32, alternating in one process, best of
``--repeats``; loss = sum of the outputs, gradients of q, k, v, g and beta.

    OMP_NUM_THREADS=2 python benchmarks/bench_delta_rule.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(2, 256, 8, 64, 64), (2, 512, 8, 128, 128), (1, 1024, 16, 128, 128)]  # b, s, heads, dk, dv


def _inputs(b: int, s: int, h: int, dk: int, dv: int) -> list:
    import paddle

    rng = np.random.default_rng(0)
    k = rng.standard_normal((b, s, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = [rng.standard_normal((b, s, h, dk)) / np.sqrt(dk), k, rng.standard_normal((b, s, h, dv)),
              -rng.uniform(0.0, 1.0, (b, s, h)), rng.uniform(0.0, 1.0, (b, s, h))]  # fmt: skip
    return [paddle.to_tensor(a, dtype="float32", stop_gradient=False) for a in arrays]


def main(repeats: int = 3) -> dict:
    from bmtrain_cli.ops import reference
    from bmtrain_cli.ops.delta_rule import gated_delta_rule

    rules = {"kernel": gated_delta_rule, "reference": reference.gated_delta_rule}
    rows = []
    for shape in SHAPES:
        tensors = _inputs(*shape)
        best = {name: float("inf") for name in rules}
        for _ in range(repeats):
            for name, rule in rules.items():
                start = time.perf_counter()
                out, _ = rule(*tensors)
                out.sum().backward()
                best[name] = min(best[name], time.perf_counter() - start)
        row = {"shape": shape, **{f"{n}_ms": round(t * 1000, 1) for n, t in best.items()}}
        row["speedup"] = round(best["reference"] / best["kernel"], 2)
        print(f"b, s, heads, dk, dv = {shape}: kernel {row['kernel_ms']} ms, reference {row['reference_ms']} ms, "
              f"{row['speedup']}x")  # fmt: skip
        rows.append(row)
    return {"rows": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    print(json.dumps(main(ap.parse_args().repeats)))
