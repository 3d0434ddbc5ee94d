"""Training step of a Qwen3-MoE-shaped model, ours against transformers, in one run: the same weights (a fresh
model of ours written with save_pretrained, which both stacks load) and the same token ids, fp32,
forward + backward + AdamW with a global-norm clip, each stack in its own process with the same
OMP_NUM_THREADS.

Shape (default ``small``): 2 layers, hidden 1024, 16 / 4 heads of 64, 64 experts, top-8, expert ffn 256,
vocab 8192, batch 1 x 512 (Qwen3-30B-A3B's expert layout: 128 experts of 768 there; fewer layers and
experts and a smaller vocabulary, to run in a few minutes on 2 shared cores). ``--shape issue`` is the
issue's 8 layers.

Stacks:
- ``ours``: bmtrain_cli's load_pretrained (``kernels: auto``: on a CPU the experts run as one grouped GEMM,
  kernels/cpu/moe_cpu.cc), CpuAdamW and the trainer's clip;
- ``ours_reference``: the same, the experts run by the per-expert reference composition (one matmul chain
  per expert, ``SparseMoE.grouped = None``), everything else equal;
- ``torch_<impl>``: transformers' Qwen3MoeForCausalLM from the reference venv, sdpa attention,
  torch.optim.AdamW and clip_grad_norm_, for transformers 5.x's experts implementations that fit in memory
  here (``eager``, a loop over the experts hit; ``grouped_mm``, torch's grouped matmul; not ``batched_mm``,
  see TORCH_IMPLS); the fastest is the baseline of the ratio.

Peak memory is each process's peak RSS (the framework's own footprint included). The stacks alternate over
the rounds; each keeps its best round.

``--qlora`` runs QLoRA stacks instead (our stack only; the experts' base in nf4, blocks of 64, quantised
while loaded; rank-8 adapters): ``ours_qlora`` runs the quantised experts as three grouped calls per layer
(quant/experts.py, one C++ launcher call for all the experts), ``ours_qlora_loop`` one expert at a time
(each projection's QuantLinear in turn), LoRA on the attention projections; ``ours_qlora_all`` and
``ours_qlora_all_loop`` the same with LoRA on every linear layer, the experts' included.

    OMP_NUM_THREADS=2 python benchmarks/bench_moe.py [--rounds 1] [--shape small|issue] [--stacks ours,...] [--qlora]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from bench_stacks import _env, _timed, _torch_python, ours_phases, torch_phases  # noqa: E402

COMMON = dict(
    hidden=1024,
    heads=16,
    kv_heads=4,
    head_dim=64,
    experts=64,
    top_k=8,
    expert_ffn=256,
    vocab=8192,
    seq=512,
    batch=1,
    warmup=1,
    steps=2,
)
SHAPES: Dict[str, dict] = {"small": dict(layers=2, **COMMON), "issue": dict(layers=8, **COMMON)}  # fmt: skip
# transformers' third CPU implementation, batched_mm, gathers each (token, expert) pair's weights: on this
# shape it grew past 20 GiB and was killed by the OOM killer, so it is left out
TORCH_IMPLS = ("eager", "grouped_mm")


def _make_checkpoint(shape: dict, out: str) -> None:
    """A fresh model of ours, written as a Hugging Face checkpoint."""
    sys.path.insert(0, str(REPO))
    import paddle

    from bmtrain_cli.config.schema import ModelConfig
    from bmtrain_cli.models import save_pretrained
    from bmtrain_cli.models.hf import build

    paddle.seed(0)
    cfg = ModelConfig(
        family="qwen3_moe", hidden_size=shape["hidden"], intermediate_size=shape["expert_ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"], vocab_size=shape["vocab"],
        num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
    )  # fmt: skip
    save_pretrained(build(cfg, kernels="reference"), out)


def _worker_ours(shape: dict, ckpt: str, grouped: bool) -> dict:
    sys.path.insert(0, str(REPO))

    from bmtrain_cli.models import load_pretrained
    from bmtrain_cli.models.moe import SparseMoE

    model = load_pretrained(ckpt)
    moe = [m for m in model.sublayers() if isinstance(m, SparseMoE)]
    assert moe and all(m.grouped is not None for m in moe), "the grouped GEMM is not built here"
    if not grouped:
        for m in moe:
            m.grouped = None
    model.train()
    return _timed(ours_phases(model, shape)[0], shape)


def _worker_qlora(shape: dict, ckpt: str, kind: str) -> dict:
    sys.path.insert(0, str(REPO))

    from bmtrain_cli.config.quant_schema import QuantizationConfig
    from bmtrain_cli.config.schema import TrainConfig
    from bmtrain_cli.lora import apply_lora
    from bmtrain_cli.models import load_pretrained, moe

    model = load_pretrained(ckpt, quantization=QuantizationConfig(method="nf4"))
    targets = "all-linear" if "_all" in kind else ["q_proj", "k_proj", "v_proj", "o_proj"]
    apply_lora(model, TrainConfig(finetuning="lora", lora_rank=8, lora_alpha=16, lora_target_modules=targets))
    if kind.endswith("_loop"):  # the layer's fallback: every expert's projections called in turn
        moe.quantised_experts = lambda *args: None
    model.train()
    return _timed(ours_phases(model, shape)[0], shape)


def _worker_torch(shape: dict, ckpt: str, impl: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=impl
    )
    model.train()
    return _timed(torch_phases(model, shape), shape)


def _run(python: str, args: list) -> Tuple[Optional[dict], str]:
    env = _env() if not args[0].startswith("torch") else dict(_env(), PYTHONPATH="", HF_HUB_OFFLINE="1")
    res = subprocess.run(
        [python, str(Path(__file__).resolve()), "--worker", *args],
        capture_output=True, text=True, env=env, timeout=1800, cwd=str(REPO),
    )  # fmt: skip
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), ""
    killed = " (killed: out of memory?)" if res.returncode in (-9, 137) else ""
    return None, f"exit {res.returncode}{killed}: " + (res.stderr.strip().splitlines() or ["no output"])[-1][
        -300:
    ]


QLORA = ("ours_qlora", "ours_qlora_loop", "ours_qlora_all", "ours_qlora_all_loop")


def main(rounds: int = 1, shape: str = "small", only: Tuple[str, ...] = (), qlora: bool = False) -> dict:
    torch_python = None if qlora else _torch_python()
    names = QLORA if qlora else ("ours", "ours_reference")
    stacks = {name: sys.executable for name in names}
    if torch_python:
        stacks.update({f"torch_{impl}": torch_python for impl in TORCH_IMPLS})
    stacks = {k: v for k, v in stacks.items() if not only or k in only}
    best: Dict[str, dict] = {}
    errors: Dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as ckpt:
        _, err = _run(sys.executable, ["make", shape, ckpt])
        if err:
            raise RuntimeError(f"could not write the checkpoint: {err}")
        for _ in range(rounds):
            for kind, python in stacks.items():
                got, err = _run(python, [kind, shape, ckpt])
                print(f"{kind}: " + (f"{got['step_s']:.3f} s/step" if got else f"failed: {err}"), flush=True)
                if got is None:
                    errors[kind] = err
                elif kind not in best or got["step_s"] < best[kind]["step_s"]:
                    best[kind] = got
    keys = ("step_s", "forward_s", "backward_s", "update_s", "tokens_per_sec", "peak_rss_mb", "first_loss")
    out: dict = {"shape": dict(name=shape, **SHAPES[shape]), "threads": _env()["OMP_NUM_THREADS"],
                 "rounds": rounds, "stacks": {k: {x: v[x] for x in keys} for k, v in best.items()},
                 "errors": errors}  # fmt: skip
    torch_runs = {k: v for k, v in best.items() if k.startswith("torch_")}
    if "ours" in best and "ours_reference" in best:
        out["grouped_vs_reference"] = best["ours_reference"]["step_s"] / best["ours"]["step_s"]
    for a, b in (QLORA[:2], QLORA[2:]):
        if a in best and b in best:
            out[f"{a}_grouped_vs_loop"] = best[b]["step_s"] / best[a]["step_s"]
    if "ours" in best and torch_runs:
        fastest = min(torch_runs, key=lambda k: torch_runs[k]["step_s"])
        out["fastest_torch"] = fastest
        out["speedup_vs_torch"] = torch_runs[fastest]["step_s"] / best["ours"]["step_s"]
        out["peak_rss_vs_torch"] = best["ours"]["peak_rss_mb"] / torch_runs[fastest]["peak_rss_mb"]
    for kind, v in best.items():
        print(f"{kind}: {v['step_s']:.3f} s/step (forward {v['forward_s']:.3f}, backward {v['backward_s']:.3f}, "
              f"update {v['update_s']:.3f}), peak RSS {v['peak_rss_mb']:.0f} MiB, first loss {v['first_loss']:.5f}")  # fmt: skip
    for key in (
        "grouped_vs_reference",
        "speedup_vs_torch",
        "peak_rss_vs_torch",
        *(f"{q}_grouped_vs_loop" for q in QLORA),
    ):
        if key in out:
            print(f"{key}: {out[key]:.2f}" + (f" ({out['fastest_torch']})" if key.endswith("_torch") else ""))
    for kind, err in errors.items():
        print(f"{kind}: failed: {err}")
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "--worker":
        kind, name, ckpt = sys.argv[2], sys.argv[3], sys.argv[4]
        spec = SHAPES[name]
        if kind == "make":
            _make_checkpoint(spec, ckpt)
            result: dict = {}
        elif kind.startswith("ours_qlora"):
            result = _worker_qlora(spec, ckpt, kind)
        elif kind.startswith("torch_"):
            result = _worker_torch(spec, ckpt, kind[len("torch_") :])
        else:
            result = _worker_ours(spec, ckpt, grouped=kind == "ours")
        print("RESULT " + json.dumps(result), flush=True)
    else:
        import argparse

        ap = argparse.ArgumentParser()
        ap.add_argument("--rounds", type=int, default=1)
        ap.add_argument("--shape", choices=tuple(SHAPES), default="small")
        ap.add_argument("--stacks", default="", help="a comma-separated subset (default: all)")
        ap.add_argument("--qlora", action="store_true", help="the QLoRA stacks (see the docstring)")
        args = ap.parse_args()
        only = tuple(filter(None, args.stacks.split(",")))
        print(json.dumps(main(args.rounds, args.shape, only, args.qlora), indent=1))
