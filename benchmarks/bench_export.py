"""Export: INT8 size ratio and eval-loss change, Paddle Inference predictor vs dygraph latency.

A 2-layer hidden-64 LLaMA (intermediate 256, sentencepiece vocab 300) is trained for 200 AdamW steps on the
arithmetic demo task, then exported fp32 and INT8 to both formats; the held-out loss is measured on 500
records. Latency: logits of a [4, 64] batch, median of 20 runs after 3 warm-ups, each path timed in the
same process. Run: `python benchmarks/run_all.py export`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _median_s(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> dict:
    from bmtrain_cli.export.loading import load_for_inference
    from bmtrain_cli.export.pipeline import export_checkpoint
    from tests.unit.export.conftest import make_checkpoint

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run = make_checkpoint(root, steps=200)
        held = str(root / "data" / "heldout.jsonl")
        for fmt in ("paddle-inference", "hf"):
            for q, emb in ((None, True), ("int8", True), ("int8", False)):
                name = f"{fmt}/{q or 'fp32'}" + ("" if emb else "/no-embeddings")
                r = export_checkpoint(
                    str(run),
                    str(root / name.replace("/", "-")),
                    fmt=fmt,
                    quantize=q,
                    eval_data=held if q else None,
                    quantize_embeddings=emb,
                    max_eval_records=500,
                    log=lambda m: None,
                )
                results[name] = {
                    "weight_bytes": r.export_weight_bytes,
                    "size_ratio": round(r.size_ratio, 4),
                    "eval_loss_fp32": r.eval_loss_fp32,
                    "eval_loss_int8": r.eval_loss_quantized,
                    "eval_loss_change_pct": None if r.eval_loss_change is None else 100 * r.eval_loss_change,
                }
                print(f"{name:40s} {results[name]}")
        ids = np.random.default_rng(0).integers(3, 250, (4, 64)).astype(np.int64)
        dyn = load_for_inference(str(run))
        base = _median_s(lambda: dyn.logits(ids))
        timing = {"dygraph_fp32_s": base}
        for name in ("paddle-inference-fp32", "paddle-inference-int8", "hf-int8"):
            m = load_for_inference(str(root / name))
            timing[f"{name}_ratio_vs_dygraph"] = _median_s(lambda m=m: m.logits(ids)) / base
        results["latency"] = timing
        print("latency (time / dygraph fp32 time):", {k: round(v, 3) for k, v in timing.items()})
    return results


if __name__ == "__main__":
    main()
