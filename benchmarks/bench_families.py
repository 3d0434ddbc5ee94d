"""Training speed of the 2026 dense families against transformers, in one run: a Gemma-3-shaped and an
ERNIE-4.5-shaped small model, random weights and the same random token ids, fp32, forward + backward +
AdamW with a global-norm clip, each stack timed in its own process with the same OMP_NUM_THREADS.

- gemma3: 6 layers (five sliding-window layers, window 128, and one global), hidden 640, 4 / 1 heads of 256,
          ffn 2048, vocab 16384, tied, batch 2 x 256 (the Gemma-3-270M layout, fewer layers and vocabulary)
- ernie:  6 layers, hidden 1024, 16 / 2 heads of 128, ffn 3072, vocab 16384, tied, batch 2 x 256
          (ERNIE-4.5-0.3B's layout, fewer layers and vocabulary)
- qwen35: 6 layers (linear, linear, linear, full, linear, linear), hidden 1024, full attention 8 / 2 heads
          of 256 with the output gate and rope on a quarter, Gated DeltaNet 16 q/k and 16 value heads of
          128, ffn 3584, vocab 16384, tied, batch 2 x 256 (Qwen3.5's small layout, fewer layers and
          vocabulary); transformers runs its torch fallback of the delta rule (no flash-linear-attention)
- gemma2: the gemma3 shape as Gemma 2 (layers alternating sliding / global, no q/k norms, scores soft-capped
          at 50 and logits at 30): ours on the blocked kernel, transformers on eager attention (its Gemma 2
          has no sdpa path: sdpa cannot cap scores)

Stacks: ``ours`` (bmtrain_cli.models.build with ``kernels: auto``, train/optimizer/adamw.build_optimizer: CpuAdamW
with the fused update, the trainer's clip) and ``torch`` (transformers' Gemma3ForCausalLM /
Ernie4_5ForCausalLM / Qwen3_5ForCausalLM with sdpa attention, Gemma2ForCausalLM with eager attention,
torch.optim.AdamW, clip_grad_norm_) from the reference venv. The
stacks alternate over the rounds; each keeps its best round. The ratio is torch's step time over ours.

    OMP_NUM_THREADS=2 python benchmarks/bench_families.py [--rounds 2] [--shapes gemma3,ernie,gemma2]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_stacks import _env, _timed, _torch_python, ours_phases, torch_phases  # noqa: E402

COMMON = dict(vocab=16384, seq=256, batch=2, warmup=2, steps=3)
SHAPES: Dict[str, dict] = {
    "gemma3": dict(family="gemma3_text", layers=6, hidden=640, heads=4, kv_heads=1, head_dim=256, ffn=2048,
                   window=128, **COMMON),
    "ernie": dict(family="ernie4_5", layers=6, hidden=1024, heads=16, kv_heads=2, head_dim=128, ffn=3072,
                  window=None, **COMMON),
    "qwen35": dict(family="qwen3_5_text", layers=6, hidden=1024, heads=8, kv_heads=2, head_dim=256, ffn=3584,
                   window=None, linear=(16, 16, 128, 128), **COMMON),
}  # fmt: skip
SHAPES["gemma2"] = dict(SHAPES["gemma3"], family="gemma2")


def _worker_ours(shape: dict) -> dict:
    sys.path.insert(0, str(REPO))
    from dataclasses import replace

    import paddle

    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.models.families import family

    paddle.seed(0)
    fam = shape["family"]
    arch = replace(ModelArch(family=fam), **family(fam).defaults)
    arch = replace(
        arch, hidden_size=shape["hidden"], intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
        vocab_size=shape["vocab"], tie_word_embeddings=True, sliding_window=shape["window"],
    )  # fmt: skip
    if "linear" in shape:  # Qwen3.5: Gated DeltaNet heads (key, value) and widths
        from bmtrain_cli.models.families._linear import LinearAttention

        arch = replace(arch, linear_attention=LinearAttention(*shape["linear"]))
    model = build(arch)
    model.train()
    return _timed(ours_phases(model, shape)[0], shape)


def _worker_torch(shape: dict) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    sizes = dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], tie_word_embeddings=True,
        max_position_embeddings=2048,
    )  # fmt: skip
    attention = "sdpa"
    if shape["family"] == "gemma2":
        cfg = transformers.Gemma2Config(**sizes, sliding_window=shape["window"], query_pre_attn_scalar=256)
        model_cls, attention = transformers.Gemma2ForCausalLM, "eager"
    elif shape["family"] == "gemma3_text":
        cfg = transformers.Gemma3TextConfig(
            **sizes, sliding_window=shape["window"], query_pre_attn_scalar=256
        )
        model_cls = transformers.Gemma3ForCausalLM
    elif shape["family"] == "qwen3_5_text":  # the delta rule on transformers' torch fallback
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        nk, nv, dk, dv = shape["linear"]
        cfg = Qwen3_5TextConfig(
            **sizes, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
            linear_value_head_dim=dv,
        )  # fmt: skip
        model_cls = Qwen3_5ForCausalLM
    else:
        cfg = transformers.Ernie4_5Config(**sizes)
        model_cls = transformers.Ernie4_5ForCausalLM
    cfg._attn_implementation = attention
    model = model_cls(cfg).float()
    model.train()
    return _timed(torch_phases(model, shape), shape)


def _run(python: str, kind: str, shape: str) -> Tuple[dict, str]:
    import subprocess

    env = _env() if kind == "ours" else dict(_env(), PYTHONPATH="")
    res = subprocess.run(
        [python, str(Path(__file__).resolve()), "--worker", kind, shape],
        capture_output=True, text=True, env=env, timeout=1500, cwd=str(REPO),
    )  # fmt: skip
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), ""
    return {}, (res.stderr.strip().splitlines() or ["no output"])[-1][-500:]


def main(rounds: int = 2, shapes: Tuple[str, ...] = ("gemma3", "ernie")) -> dict:
    torch_python = _torch_python()
    pythons = {"ours": sys.executable, **({"torch": torch_python} if torch_python else {})}
    best: Dict[str, Dict[str, dict]] = {s: {} for s in shapes}
    errors: Dict[str, str] = {}
    for _ in range(rounds):
        for shape in shapes:
            for kind, python in pythons.items():
                got, err = _run(python, kind, shape)
                if err:
                    errors[f"{kind}/{shape}"] = err
                    continue
                if kind not in best[shape] or got["step_s"] < best[shape][kind]["step_s"]:
                    best[shape][kind] = got
    out: dict = {"threads": _env()["OMP_NUM_THREADS"], "rounds": rounds, "shapes": {}, "errors": errors}
    for shape, runs in best.items():
        row = {k: {"step_s": v["step_s"], "tokens_per_sec": v["tokens_per_sec"], "peak_rss_mb": v["peak_rss_mb"],
                   "first_loss": v["first_loss"]} for k, v in runs.items()}  # fmt: skip
        if "ours" in runs and "torch" in runs:
            row["speedup_vs_torch"] = runs["torch"]["step_s"] / runs["ours"]["step_s"]
        out["shapes"][shape] = row
        print(f"{shape}: " + ", ".join(f"{k} {v['step_s']:.3f} s/step" for k, v in runs.items())
              + (f"; ours {row['speedup_vs_torch']:.2f}x transformers" if "speedup_vs_torch" in row else ""))  # fmt: skip
    for key, err in errors.items():
        print(f"{key}: failed: {err}")
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        kind, name = sys.argv[2], sys.argv[3]
        fn = _worker_ours if kind == "ours" else _worker_torch
        print("RESULT " + json.dumps(fn(SHAPES[name])), flush=True)
    else:
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("--rounds", type=int, default=2)
        ap.add_argument("--shapes", default="gemma3,ernie")
        args = ap.parse_args()
        print(json.dumps(main(args.rounds, tuple(args.shapes.split(","))), indent=1))
