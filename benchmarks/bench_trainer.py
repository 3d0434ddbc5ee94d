"""Trainer overhead, to_static speed-up and recompute memory.

1. Throughput: `bmtrain train`'s loop (data loader, schedule, fp32 grad norm + clip, metrics, TensorBoard)
   against a bare hand-written loop (loss_sum / count, backward, AdamW with Paddle's global-norm clip)
   over the same initial weights and the same batches. The two loops run INTERLEAVED in one process: after
   each trainer step (a step callback) the bare loop runs one step on its own copy of the model, so both
   see the same machine load and the same OMP thread count. Target: >= 0.95x. The same is done with
   ``to_static: true`` (the trainer's compiled step against the same eager bare loop): the ratio of the two
   ratios is the to_static speed-up.
2. Gradient checkpointing: peak memory (summary.json's peak_memory_bytes: Paddle's allocator peak on CPU)
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

STEPS = 30
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
  {data}
  output_dir: {out}
  overwrite_output_dir: true
  max_steps: {steps}
  micro_batch_size: {micro}
  batching: {batching}
  learning_rate: 1.0e-3
  logging_steps: 10
  save_steps: 100000
  num_workers: 1
  gradient_checkpointing: {recompute}
  to_static: {static}
"""


def _write_config(
    tmp: Path, name: str, data: str = "demo_data: arithmetic", static: str = "false", **kw: Any
) -> str:
    p = tmp / f"{name}.yaml"
    p.write_text(CONFIG.format(out=tmp / name, data=data, static=static, **kw), encoding="utf-8")
    return str(p)


def throughput(tmp: Path, to_static: bool = False) -> Dict[str, float]:
    """Trainer (optionally to_static) and the bare eager loop, one step each in turn."""
    import paddle

    from bmtrain_cli.config import load_config
    from bmtrain_cli.data.demo import write_demo_data
    from bmtrain_cli.models import build
    from bmtrain_cli.models.scoring import to_tensors
    from bmtrain_cli.train.run import load_recipe

    train_path, _ = write_demo_data(str(tmp / "data"), task="arithmetic", seed=0)
    name = "speed-static" if to_static else "speed"
    cfg = _write_config(
        tmp,
        name,
        data=f"data_path: {train_path}",  # no held-out split: no accuracy decoding around the loop
        static="true" if to_static else "false",
        hidden=128,
        inter=344,
        layers=2,
        seq=128,
        micro=16,
        batching="packed",
        steps=STEPS,
        recompute="false",
    )
    parts, run_state = load_recipe("sft").setup(load_config(cfg, mode="train"), stream=open(os.devnull, "w"))
    # the batches the trainer will see (grad accumulation 1), then rewind its loader
    loader = parts.data.loader
    state = loader.state_dict()
    it = iter(loader)
    batches = [next(it) for _ in range(STEPS)]
    loader.load_state_dict(state)

    # the bare loop: its own model with the trainer's initial weights, plain AdamW with global-norm clip
    bare = build(parts.model.raw.arch, kernels="reference")
    bare.set_state_dict({k: paddle.to_tensor(v.numpy()) for k, v in parts.model.raw.state_dict().items()})
    bare.train()
    opt = paddle.optimizer.AdamW(
        learning_rate=1e-3,
        parameters=bare.parameters(),
        weight_decay=0.0,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )
    bare_losses: List[float] = []
    trainer_losses: List[float] = []
    trainer_s: List[float] = []
    bare_s: List[float] = []
    mark = [0.0]

    def bare_step(parts: Any, run_state: Any, out: Any) -> None:
        t_trainer_end = time.perf_counter()
        if run_state.step > 1:
            trainer_s.append(t_trainer_end - mark[0])  # everything of the trainer's loop for this step
        trainer_losses.append(out.loss)
        t = to_tensors(batches[run_state.step - 1])
        loss_sum, count = bare.loss_sum(**t)
        (loss_sum / count).backward()
        opt.step()
        opt.clear_grad()
        bare_losses.append(float(loss_sum) / float(count))
        mark[0] = time.perf_counter()
        bare_s.append(mark[0] - t_trainer_end)

    load_recipe("sft").train(parts, run_state, bare_step)
    tokens = [float((b["attention_mask"] > 0).sum()) for b in batches]
    # trainer_s[i] is step i + 2 (the first step has no start mark); bare_s[i] is step i + 1
    trainer_tps = sum(tokens[WARMUP:]) / sum(trainer_s[WARMUP - 1 :])
    bare_tps = sum(tokens[WARMUP:]) / sum(bare_s[WARMUP:])
    return {
        "bare_tokens_per_sec": bare_tps,
        "trainer_tokens_per_sec": trainer_tps,
        "ratio": trainer_tps / bare_tps,
        "first_step_loss_diff": abs(trainer_losses[0] - bare_losses[0]),
        "omp_threads": float(os.environ.get("OMP_NUM_THREADS") or 1),
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
            f"throughput (h128, 2 layers, 16 x 128 packed tokens, {STEPS - WARMUP} timed steps, interleaved, "
            f"OMP threads {speed['omp_threads']:.0f}): bare loop {speed['bare_tokens_per_sec']:.0f} tokens/s, "
            f"bmtrain train {speed['trainer_tokens_per_sec']:.0f} tokens/s -> {speed['ratio']:.3f}x "
            f"(first-step loss difference {speed['first_step_loss_diff']:.2e})"
        )
        static = throughput(tmp, to_static=True)
        print(
            f"to_static: bare loop {static['bare_tokens_per_sec']:.0f} tokens/s, bmtrain train to_static "
            f"{static['trainer_tokens_per_sec']:.0f} tokens/s -> {static['ratio']:.3f}x; speed-up over the "
            f"dygraph trainer {static['ratio'] / speed['ratio']:.2f}x"
        )
        if os.environ.get("BENCH_TRAINER_SKIP_MEMORY"):
            return {"throughput": speed, "to_static": static}
        mem = recompute_memory(tmp)
        print(
            f"recompute (h256, 6 layers, 8 x 512 packed tokens): peak memory {mem['peak_memory_mib_off']:.0f} MiB "
            f"off -> {mem['peak_memory_mib_on']:.0f} MiB on ({mem['memory_ratio']:.2f}x); train time "
            f"{mem['train_time_s_off']:.1f}s -> {mem['train_time_s_on']:.1f}s"
        )
    return {"throughput": speed, "to_static": static, "recompute": mem}


if __name__ == "__main__":
    main()
