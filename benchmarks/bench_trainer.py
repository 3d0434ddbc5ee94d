"""Trainer overhead and recompute memory.

1. Throughput: `bmtrain train`'s loop (data loader, schedule, fp32 grad norm + clip, metrics, TensorBoard)
   against a bare hand-written loop (loss_sum / count, backward, AdamW with Paddle's global-norm clip)
   over the same model and the same batches, in the same run. Target: >= 0.95x.
2. Gradient checkpointing: peak memory (peak RSS minus RSS before the model, as summary.json reports it)
   of the same training with recompute off and on, each in a fresh process.

    python benchmarks/run_all.py trainer
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = 40
WARMUP = 5

CONFIG = """
model_config:
  family: llama
  hidden_size: {hidden}
  intermediate_size: {inter}
  num_hidden_layers: {layers}
  num_attention_heads: 4
  max_seq_len: {seq}
  kernels: reference
train_config:
  demo_data: arithmetic
  output_dir: {out}
  overwrite_output_dir: true
  max_steps: {steps}
  micro_batch_size: {micro}
  batching: {batching}
  learning_rate: 1.0e-3
  logging_steps: 1000
  save_steps: 100000
  num_workers: 1
  gradient_checkpointing: {recompute}
"""


def _write_config(tmp: Path, name: str, **kw: Any) -> str:
    p = tmp / f"{name}.yaml"
    p.write_text(CONFIG.format(out=tmp / name, **kw), encoding="utf-8")
    return str(p)


def throughput(tmp: Path) -> Dict[str, float]:
    import paddle

    from bmtrain_cli.config import load_config
    from bmtrain_cli.train.evaluate import to_tensors
    from bmtrain_cli.train.trainer import Trainer, seed_everything

    cfg = _write_config(
        tmp,
        "speed",
        hidden=128,
        inter=344,
        layers=2,
        seq=128,
        micro=16,
        batching="packed",
        steps=STEPS,
        recompute="false",
    )
    loaded = load_config(cfg, mode="train")
    trainer = Trainer(loaded, stream=open(os.devnull, "w"))  # noqa: SIM115
    # the same batches the trainer will see, and a copy of its initial weights
    batches = [next(it) for it in [iter(trainer.loader)] for _ in range(STEPS)]
    trainer.loader.load_state_dict({**trainer.loader.state_dict(), "epoch": 0, "offset": 0})
    init = {k: v.numpy().copy() for k, v in trainer.raw_model.state_dict().items()}

    stamps: List[float] = []

    from bmtrain_cli.train import metrics as metrics_mod

    orig = metrics_mod.MetricsWriter.log_train

    def timed(self: Any, step: int, values: Dict[str, Any]) -> None:
        orig(self, step, values)
        stamps.append(time.perf_counter())

    metrics_mod.MetricsWriter.log_train = timed  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        metrics_mod.MetricsWriter.log_train = orig  # type: ignore[method-assign]
    tokens = [float((b["attention_mask"] > 0).sum()) for b in batches]
    trainer_tps = sum(tokens[WARMUP:]) / (stamps[-1] - stamps[WARMUP - 1])

    # bare loop over the same model (fresh weights = the trainer's initial ones) and batches
    seed_everything(0)
    model = trainer.raw_model
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in init.items()})
    opt = paddle.optimizer.AdamW(
        learning_rate=1e-3, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0)
    )
    times = []
    for b in batches:
        t = to_tensors(b)
        loss_sum, count = model.loss_sum(**t)
        (loss_sum / count).backward()
        opt.step()
        opt.clear_grad()
        float(loss_sum)
        times.append(time.perf_counter())
    bare_tps = sum(tokens[WARMUP:]) / (times[-1] - times[WARMUP - 1])
    return {
        "bare_tokens_per_sec": bare_tps,
        "trainer_tokens_per_sec": trainer_tps,
        "ratio": trainer_tps / bare_tps,
    }


def recompute_memory(tmp: Path) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for flag in ("false", "true"):
        cfg = _write_config(
            tmp,
            f"mem-{flag}",
            hidden=256,
            inter=688,
            layers=6,
            seq=512,
            micro=8,
            batching="packed",
            steps=3,
            recompute=flag,
        )
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "bmtrain_cli", "train", "--config", cfg],
            check=True,
            env=env,
            capture_output=True,
            cwd=str(REPO),
        )
        summary = json.loads((tmp / f"mem-{flag}" / "summary.json").read_text())
        key = "on" if flag == "true" else "off"
        out[f"peak_memory_mib_{key}"] = summary["peak_memory_bytes"] / 2**20
        out[f"train_time_s_{key}"] = summary["train_time_s"]
        out[f"wall_s_{key}"] = time.perf_counter() - t0
    out["memory_ratio"] = out["peak_memory_mib_on"] / out["peak_memory_mib_off"]
    return out


def main() -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        speed = throughput(tmp)
        print(
            f"throughput (h128, 2 layers, 16 x 128 packed tokens, {STEPS - WARMUP} timed steps): "
            f"bare loop {speed['bare_tokens_per_sec']:.0f} tokens/s, bmtrain train "
            f"{speed['trainer_tokens_per_sec']:.0f} tokens/s -> {speed['ratio']:.3f}x"
        )
        mem = recompute_memory(tmp)
        print(
            f"recompute (h256, 6 layers, 8 x 512 packed tokens): peak memory {mem['peak_memory_mib_off']:.0f} MiB "
            f"off -> {mem['peak_memory_mib_on']:.0f} MiB on ({mem['memory_ratio']:.2f}x); train time "
            f"{mem['train_time_s_off']:.1f}s -> {mem['train_time_s_on']:.1f}s"
        )
    return {"throughput": speed, "recompute": mem}


if __name__ == "__main__":
    main()
