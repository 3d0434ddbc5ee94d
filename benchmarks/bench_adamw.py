"""The optimizer update with its global-norm clip on the SmolLM2-135M parameter shapes: Paddle's AdamW and
our CpuAdamW (the multi-tensor fused kernel, kernels/cpu/adamw_cpu.cc), optionally the CpuAdamW of another
checkout (``--baseline DIR``, e.g. a worktree of an older commit) and PyTorch's AdamW (``--torch PYTHON``,
an interpreter with torch).

Parameters: a LLaMA built by bmtrain_cli.models.build with the SmolLM2-135M shape (30 layers, hidden 576,
9 / 3 heads, intermediate 1536, vocab 49152, tied: 272 tensors, 134.5M parameters), fixed random gradients
(global norm ~11.6) clipped to 1.0, so the clip fires every step. A step is what the trainer does after
backward (train/loop/step.py): the global norm (train/optimizer/adamw.grad_norm_tensor, read on the host), the clip
(``clip_for_step`` where the checkout has it: folded into CpuAdamW's update; otherwise ``clip_grads_``),
``opt.step()``; torch: ``clip_grad_norm_`` and ``step()``, with its default (foreach) AdamW and with
``fused=True`` (its fused CPU kernel). Each
optimizer runs in its own process (Paddle's AdamW slows the rest of its process, see
bench_adam_slowdown.py), rounds alternate them, and a step is timed by wall clock and by process CPU time
(the CPU time holds better on a shared machine). Run with OMP_NUM_THREADS=2:

    OMP_NUM_THREADS=2 python benchmarks/bench_adamw.py [--rounds 2] [--baseline DIR] [--torch PYTHON]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
STEPS = 5
MAX_NORM = 1.0


def _params(tree: Path) -> list:
    import paddle

    sys.path.insert(0, str(tree))
    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch

    paddle.seed(0)
    arch = ModelArch(
        family="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
    )  # fmt: skip
    return [p for p in build(arch, kernels="reference").parameters() if not p.stop_gradient]


def _paddle_worker(kind: str, tree: Path) -> dict:
    import paddle

    params = _params(tree)
    grads = [paddle.randn(p.shape, dtype=p.dtype) * 1e-3 for p in params]
    from bmtrain_cli.train.optimizer import adamw as optim
    from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW

    kw = dict(learning_rate=3e-4, parameters=params, weight_decay=0.01)
    opt = paddle.optimizer.AdamW(**kw) if kind == "paddle AdamW" else CpuAdamW(fused=True, **kw)
    clip = getattr(optim, "clip_for_step", None) or (lambda _o, p, m, n: optim.clip_grads_(p, m, n))

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g.clone()  # a fresh gradient each step, as after backward (outside the timing below)
        t0, c0 = time.perf_counter(), time.process_time()
        norm = float(optim.grad_norm_tensor(params))
        clip(opt, params, MAX_NORM, norm)
        opt.step()
        opt.clear_grad(set_to_zero=False)
        step.elapsed = (time.perf_counter() - t0, time.process_time() - c0)  # type: ignore[attr-defined]

    return {"n_params": sum(p.size for p in params), "shapes": [list(p.shape) for p in params],
            **_timed(step)}  # fmt: skip


def _timed(step) -> dict:
    """Median wall and process CPU time of STEPS steps after a first one (which creates the moments); each
    step reports its own (wall, cpu) in ``step.elapsed``, without setting up its gradients."""
    step()
    wall, cpu = [], []
    for _ in range(STEPS):
        step()
        wall.append(step.elapsed[0])
        cpu.append(step.elapsed[1])
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}


def _torch_worker(shapes_file: str, fused: bool) -> dict:
    import torch

    torch.manual_seed(0)
    shapes = json.loads(Path(shapes_file).read_text())
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    grads = [torch.randn(s) * 1e-3 for s in shapes]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, **({"fused": True} if fused else {}))

    def step() -> None:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        t0, c0 = time.perf_counter(), time.process_time()
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.elapsed = (time.perf_counter() - t0, time.process_time() - c0)  # type: ignore[attr-defined]

    return {"n_params": sum(p.numel() for p in params), "threads": torch.get_num_threads(), **_timed(step)}


def _run(cmd: List[str], env: dict) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int = 2, baseline: Optional[str] = None, torch_python: Optional[str] = None) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "2")
    kinds: Dict[str, Tuple[List[str], dict]] = {
        "paddle AdamW": ([sys.executable, __file__, "--worker", "paddle AdamW", str(REPO)], env),
        "CpuAdamW multi-tensor, clip folded": (
            [sys.executable, __file__, "--worker", "CpuAdamW", str(REPO)],
            env,
        ),
    }
    if baseline:
        kinds[f"CpuAdamW at {baseline}"] = ([sys.executable, __file__, "--worker", "CpuAdamW", baseline], env)
    shapes_file = None
    if torch_python:
        shapes_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False).name
        torch_env = dict(env, PYTHONPATH="")
        for mode in ("foreach", "fused"):  # torch's default, and its fused CPU kernel (fused=True)
            cmd = [torch_python, __file__, "--torch-worker", shapes_file, mode]
            kinds[f"torch AdamW ({mode})"] = (cmd, torch_env)
    runs: dict = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind, (cmd, kenv) in kinds.items():
            r = _run(cmd, kenv)
            if shapes_file and "shapes" in r and not Path(shapes_file).stat().st_size:
                Path(shapes_file).write_text(json.dumps(r["shapes"]))
            r.pop("shapes", None)
            runs[kind].append(r)
    first = runs["paddle AdamW"][0]
    print(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, {first['n_params']:,} parameters, global norm clipped "
          f"to {MAX_NORM}, median of {STEPS} steps, best of {rounds} rounds")  # fmt: skip
    print(
        "| update (norm + clip + step) | wall s/step | CPU s/step | wall vs paddle AdamW |\n|---|---|---|---|"
    )
    best = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    base = best["paddle AdamW"]["wall_s"]
    for kind, r in best.items():
        print(f"| {kind} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['wall_s'] / base:.2f}x |")
    return {k: {"wall_s": r["wall_s"], "cpu_s": r["cpu_s"], "all": runs[k]} for k, r in best.items()}


def _arg(name: str) -> Optional[str]:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        print(json.dumps(_paddle_worker(sys.argv[2], Path(sys.argv[3]))), flush=True)
    elif len(sys.argv) >= 4 and sys.argv[1] == "--torch-worker":
        print(json.dumps(_torch_worker(sys.argv[2], sys.argv[3] == "fused")), flush=True)
    else:
        main(int(_arg("--rounds") or 2), _arg("--baseline"), _arg("--torch"))
