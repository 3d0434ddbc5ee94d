"""``model_config.kernels``: reference vs custom vs auto on the shipped quickstart, through `bmtrain train`.

Each mode trains configs/quickstart.yaml (hidden 128, 2 layers, seq 64, micro-batch 64) for ``STEPS`` steps
in its own process (no held-out evaluation, no checkpoint), the modes alternating over the rounds; the
figure is the median of metrics.jsonl's ``tokens_per_sec`` after the first ``SKIP`` steps, best round.
``auto`` includes its start-up timing of the candidates (ops/measure.py), which metrics do not count; the
choice it made is printed from the run's log.

    OMP_NUM_THREADS=2 python benchmarks/bench_kernel_choice.py [--rounds 2]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
MODES = ("reference", "custom", "auto")
STEPS, SKIP = 30, 5


def _run(mode: str, out: Path) -> float:
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(REPO / "configs/quickstart.yaml")]
    for kv in (
        f"model_config.kernels={mode}",
        f"train_config.max_steps={STEPS}",
        "train_config.eval_steps=null",
        f"train_config.save_steps={STEPS * 10}",
        f"train_config.output_dir={out}",
        "train_config.logging_steps=1",
    ):
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=str(REPO))
    env.setdefault("OMP_NUM_THREADS", "2")
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=str(out.parent))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tps = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r and r.get("step", 0) > SKIP]
    return statistics.median(tps)


def main(rounds: int = 2) -> dict:
    runs: Dict[str, List[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for mode in MODES:
                tps = _run(mode, Path(tmp) / f"{mode}-{r}")
                runs[mode].append(tps)
                print(f"  round {r + 1} {mode:9s} {tps:8.0f} tokens/s", flush=True)
    best = {m: max(v) for m, v in runs.items()}
    print("| kernels | tokens/s (best round) | vs reference | all rounds |\n|---|---|---|---|")
    for m, v in best.items():
        print(f"| {m} | {v:.0f} | {v / best['reference']:.2f}x | {', '.join(f'{x:.0f}' for x in runs[m])} |")
    return {"best": best, "runs": runs}


if __name__ == "__main__":
    main(int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 2)
