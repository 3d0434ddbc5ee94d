"""Gradient compression for the data-parallel all-reduce: bytes per rank and time per step.

Launches 2 gloo ranks (python -m paddle.distributed.launch) that reduce a gradient of N fp32 values
(the size of a small model) with the dense all-reduce (baseline), int8 and top-k (1%), and report
bytes each rank sends and the time per reduction relative to the dense one in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NUMEL = 2_000_000
REPEAT = 5


def worker(out: str) -> None:
    import paddle
    import paddle.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bmtrain_cli.parallel.compression import Int8Compressor, TopKCompressor

    dist.init_parallel_env()
    group = dist.new_group([0, 1])
    paddle.seed(dist.get_rank())
    p = paddle.create_parameter([NUMEL], "float32")
    results = {}
    for name, comp in (("dense", None), ("int8", Int8Compressor()), ("topk_1pct", TopKCompressor(0.01))):
        times = []
        for _ in range(REPEAT):
            p.grad = None
            (p * paddle.randn([NUMEL])).sum().backward()
            dist.barrier()
            t0 = time.perf_counter()
            if comp is None:
                dist.all_reduce(p.grad, group=group)
            else:
                comp.all_reduce_sum([p], group)
            times.append(time.perf_counter() - t0)
        sent = NUMEL * 4 if comp is None else comp.bytes_sent // comp.steps
        results[name] = {"seconds": sorted(times)[len(times) // 2], "bytes_per_rank": sent}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            "2",
            "--log_dir",
            os.path.join(tmp, "log"),
            __file__,
            "--worker",
            out,
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        res = json.loads(Path(out).read_text())
    base = res["dense"]
    print(f"gradient of {NUMEL:,} fp32 values, 2 gloo ranks, median of {REPEAT}")
    print(f"{'method':<12}{'bytes/rank':>14}{'vs dense':>10}{'time':>10}{'vs dense':>10}")
    for name, r in res.items():
        r["bytes_ratio"] = base["bytes_per_rank"] / r["bytes_per_rank"]
        r["time_ratio"] = r["seconds"] / base["seconds"]
        print(
            f"{name:<12}{r['bytes_per_rank']:>14,}{r['bytes_ratio']:>9.1f}x{r['seconds']:>9.3f}s"
            f"{r['time_ratio']:>9.2f}x"
        )
    return res


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
