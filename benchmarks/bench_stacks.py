"""Training speed of three stacks in one run: our trainer's step, PaddleFormers, PyTorch/transformers.

Two shapes (issue 17), random weights and random token ids, fp32, forward + backward + AdamW:

- toy:  4 layers, hidden 256, 4 / 4 heads, ffn 688, vocab 8000, batch 8 x 256
- real: the SmolLM2-135M shape: 30 layers, hidden 576, 9 / 3 heads, ffn 1536, vocab 49152, tied
        embeddings, batch 2 x 190

Stacks, each step timed in its own process with the same OMP_NUM_THREADS (default 2):

- ours:        what `bmtrain train` runs per step with the shipped defaults: bmtrain_cli.models.build
               (``kernels: auto``), train/optimizer/adamw.build_optimizer (CpuAdamW with the fused C++ update on the
               CPU), loss_sum / count, backward, the fp32 global grad norm and clip (clip 1.0), step
- ours_static: the same with ``to_static: true`` (train/loop/to_static.compile_loss_sum)
- ours_release: ours with ``train_config.host_memory: release`` (freed tensors returned to the OS); the
               "ours" stacks run ``reuse``, what ``auto`` picks whenever twice the plan fits in RAM (it
               does here: ~3 GB for the 135M shape)
- paddleformers: paddleformers.transformers.LlamaForCausalLM with paddle.optimizer.AdamW and Paddle's
               global-norm clip (benchmarks/.venv-pf, created on first use by bench_model.py's helper), with
               MKL's own CPU dispatch (MKL_DEBUG_CPU_TYPE unset: what a PaddleFormers user gets)
- paddleformers_mkl: the same with MKL_DEBUG_CPU_TYPE=5 (what ``import bmtrain_cli`` sets on AMD CPUs,
               bmtrain_cli/cpu_env.py), to separate that setting from the rest of our stack
- torch:       transformers.LlamaForCausalLM (sdpa attention) with torch.optim.AdamW and
               clip_grad_norm_, from the reference venv (/work/main/.venv-ref or $BENCH_TORCH_PYTHON)

The stacks alternate (round 1: ours, PaddleFormers, torch, ...; round 2 again), so load on a shared machine
hits all of them; each stack's best round is kept. Each step is split into forward, backward and update
(eager CPU ops are synchronous, so the split is exact for the eager stacks; under to_static the forward
and backward are the compiled programs). MFU = tokens/s x training FLOPs per token / the fp32 matmul peak
measured in the same run (a 2048^3 matmul, best of 5, in Paddle and in torch; the higher one).

    OMP_NUM_THREADS=2 python benchmarks/bench_stacks.py [--rounds 2] [--shapes toy,real] [--stacks ...]
        [--shape NAME=layers,hidden,heads,kv_heads,ffn,vocab,seq,batch,tied]

``--shape`` (repeatable) adds a shape of your own to the run, e.g. ``--shape q05=24,896,14,2,4864,151936,
256,1,1`` (Qwen2.5-0.5B's layout; tied 1/0); ``--shapes`` then picks among all of them (default: every shape).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SHAPES: Dict[str, dict] = {
    "toy": dict(layers=4, hidden=256, heads=4, kv_heads=4, ffn=688, vocab=8000, seq=256, batch=8, tied=False,
                warmup=2, steps=5),
    "real": dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152, seq=190, batch=2, tied=True,
                 warmup=2, steps=3),
}  # fmt: skip
STACKS = ("ours", "ours_static", "ours_release", "paddleformers", "paddleformers_mkl", "torch")
LR, CLIP = 1e-4, 1.0


# ---------------------------------------------------------------- workers (run in subprocesses)
def _timed(phases: Dict[str, Callable[[], object]], shape: dict) -> dict:
    """Run warmup + steps steps of the phases in order; medians of each phase over the timed steps."""
    import resource

    per: Dict[str, List[float]] = {k: [] for k in phases}
    losses = []
    usage = None
    for i in range(shape["warmup"] + shape["steps"]):
        if i == shape["warmup"]:
            usage = resource.getrusage(resource.RUSAGE_SELF)
        for name, fn in phases.items():
            t0 = time.perf_counter()
            out = fn()
            if i >= shape["warmup"]:
                per[name].append(time.perf_counter() - t0)
            if name == "forward":
                losses.append(float(out))
    steps = [sum(x) for x in zip(*per.values())]
    step = statistics.median(steps)
    res = {f"{k}_s": statistics.median(v) for k, v in per.items()}
    res.update(step_s=step, tokens_per_sec=shape["batch"] * shape["seq"] / step, first_loss=losses[0])
    res["last_loss"] = losses[-1]
    end = resource.getrusage(resource.RUSAGE_SELF)
    n = shape["steps"]
    # page faults and kernel/user CPU per timed step: they do not depend on the machine's load
    res.update(
        peak_rss_mb=end.ru_maxrss / 1024,
        page_faults_per_step=(end.ru_minflt - usage.ru_minflt) / n,
        sys_s_per_step=(end.ru_stime - usage.ru_stime) / n,
        user_s_per_step=(end.ru_utime - usage.ru_utime) / n,
    )
    return res


def _ids(shape: dict):
    import numpy as np

    return np.random.default_rng(0).integers(0, shape["vocab"], (shape["batch"], shape["seq"]))


def ours_phases(
    model: object, shape: dict, loss_sum: Optional[Callable] = None
) -> Tuple[Dict[str, Callable[[], object]], object]:
    """Our training step on ``model`` (a bmtrain_cli CausalLM) as _timed's phases, with the trainer's
    optimizer (CpuAdamW on a CPU, the clip folded into its update as in train/loop/step.py)."""
    from types import SimpleNamespace

    import paddle

    from bmtrain_cli.train.optimizer.adamw import build_optimizer, clip_for_step, grad_norm_tensor

    cfg = SimpleNamespace(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0)
    opt = build_optimizer(model, cfg, LR)
    params = [p for p in model.parameters() if not p.stop_gradient]
    loss_fn = loss_sum or model.loss_sum
    ids = paddle.to_tensor(_ids(shape), dtype="int64")
    state: dict = {}

    def forward():
        total, count = loss_fn(ids, ids)
        state["loss"] = total / count
        return state["loss"]

    def backward():
        state["loss"].backward()

    def update():
        norm = float(grad_norm_tensor(params))  # the trainer brings the norm to the host once per step
        clip_for_step(opt, params, CLIP, norm)
        opt.step()
        opt.clear_grad(set_to_zero=False)  # the trainer's: gradients freed until the next backward

    return {"forward": forward, "backward": backward, "update": update}, opt


def torch_phases(model: object, shape: dict) -> Dict[str, Callable[[], object]]:
    """transformers' training step on ``model`` as _timed's phases: torch.optim.AdamW, clip_grad_norm_."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    ids = torch.from_numpy(_ids(shape))
    state: dict = {}

    def forward():
        state["loss"] = model(input_ids=ids, labels=ids).loss
        return state["loss"]

    def backward():
        state["loss"].backward()

    def update():
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"forward": forward, "backward": backward, "update": update}


def _worker_ours(shape: dict, static: bool, host: str = "reuse") -> dict:
    sys.path.insert(0, str(REPO))

    import paddle

    import bmtrain_cli  # noqa: F401  (its MKL setting, bmtrain_cli/cpu_env.py, applies from the first matmul)
    from bmtrain_cli.plan import host_memory

    host_memory.apply(host)  # as train/setup.py does on a CPU (train_config.host_memory)
    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.train.loop.to_static import compile_loss_sum

    paddle.seed(0)
    arch = ModelArch(
        family="llama", hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], head_dim=shape["hidden"] // shape["heads"],
        vocab_size=shape["vocab"], tie_word_embeddings=shape["tied"],
    )  # fmt: skip
    model = build(arch)  # model_config.kernels default: auto
    model.train()
    phases, opt = ours_phases(model, shape, compile_loss_sum(model) if static else None)
    res = _timed(phases, shape)
    res["optimizer"] = f"{type(opt).__name__}(fused={getattr(opt, 'fused', None)})"
    return res


def _worker_paddleformers(shape: dict) -> dict:
    import paddle
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    paddle.seed(0)
    cfg = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048, fuse_rms_norm=False,
        tie_word_embeddings=shape["tied"],
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.train()
    opt = paddle.optimizer.AdamW(
        learning_rate=LR, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP)
    )
    ids = paddle.to_tensor(_ids(shape), dtype="int64")
    state: dict = {}

    def forward():
        out = model(input_ids=ids, labels=ids)
        state["loss"] = out[0] if isinstance(out, (tuple, list)) else out.loss
        return state["loss"]

    def backward():
        state["loss"].backward()

    def update():
        opt.step()
        opt.clear_grad(set_to_zero=False)  # the trainer's: gradients freed until the next backward

    return _timed({"forward": forward, "backward": backward, "update": update}, shape)


def _worker_torch(shape: dict) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    cfg = LlamaConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048,
        tie_word_embeddings=shape["tied"], attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).float()
    model.train()
    return _timed(torch_phases(model, shape), shape)


def _worker_peak(framework: str) -> dict:
    n = 2048
    if framework == "paddle":
        sys.path.insert(0, str(REPO))
        import bmtrain_cli  # noqa: F401  (its MKL setting, as in the "ours" stacks)
    if framework == "torch":
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
        a, b = torch.randn(n, n), torch.randn(n, n)
        mm = lambda: float(torch.matmul(a, b)[0, 0])  # noqa: E731
    else:
        import paddle

        a, b = paddle.randn([n, n]), paddle.randn([n, n])
        mm = lambda: float(paddle.matmul(a, b)[0, 0])  # noqa: E731
    mm()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        mm()
        best = min(best, time.perf_counter() - t0)
    return {"gflops": 2 * n**3 / best / 1e9}


def worker(kind: str, shape_name: str) -> dict:
    shape = SHAPES.get(shape_name, {})
    if kind == "ours":
        return _worker_ours(shape, False)
    if kind == "ours_static":
        return _worker_ours(shape, True)
    if kind == "ours_release":
        return _worker_ours(shape, False, host="release")
    if kind in ("paddleformers", "paddleformers_mkl"):
        return _worker_paddleformers(shape)
    if kind == "torch":
        return _worker_torch(shape)
    return _worker_peak(shape_name)  # kind "peak", shape_name = framework


# ---------------------------------------------------------------- driver
def flops_per_token(s: dict) -> float:
    """6 x matmul parameters (q, k, v, o, gate, up, down, LM head) + 12 x layers x seq x hidden."""
    h, kv = s["hidden"], s["kv_heads"] * (s["hidden"] // s["heads"])
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * s["ffn"]
    return 6 * (s["layers"] * per_layer + h * s["vocab"]) + 12 * s["layers"] * s["seq"] * h


def _env() -> Dict[str, str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def _torch_python() -> Optional[str]:
    for cand in (
        os.environ.get("BENCH_TORCH_PYTHON"),
        "/work/main/.venv-ref/bin/python",
        str(REPO / ".venv-ref/bin/python"),
    ):
        if cand and Path(cand).exists():
            return cand
    return None


def _stack_env(kind: str) -> Dict[str, str]:
    env = _env()
    if kind == "paddleformers":
        env["MKL_DEBUG_CPU_TYPE"] = ""  # empty: MKL's own dispatch (kept as set by bmtrain_cli/cpu_env.py)
    elif kind == "paddleformers_mkl":
        env["MKL_DEBUG_CPU_TYPE"] = "5"
    return env


def _run(python: str, kind: str, shape: str, timeout: int = 1500) -> Tuple[Optional[dict], str]:
    cmd = [python, str(Path(__file__).resolve()), "--worker", kind, shape]
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, env=_stack_env(kind), timeout=timeout, cwd=str(REPO)
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout}s"
    for line in reversed(res.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]), ""
    return None, (res.stderr.strip().splitlines() or ["no output"])[-1][-500:]


def _pythons() -> Tuple[Dict[str, str], Dict[str, str]]:
    sys.path.insert(0, str(HERE))
    from bench_model import ensure_paddleformers

    pythons = {"ours": sys.executable, "ours_static": sys.executable, "ours_release": sys.executable}
    errors: Dict[str, str] = {}
    pf, err = ensure_paddleformers()
    if pf:
        pythons["paddleformers"] = pythons["paddleformers_mkl"] = pf
    else:
        errors["paddleformers"] = err
    tp = _torch_python()
    if tp:
        pythons["torch"] = tp
    else:
        errors["torch"] = (
            "no reference venv with torch + transformers (make ref-venv, or set BENCH_TORCH_PYTHON)"
        )
    return pythons, errors


def main(
    rounds: int = 2, shapes: Tuple[str, ...] = ("toy", "real"), stacks: Tuple[str, ...] = STACKS
) -> dict:
    env = _env()
    pythons, errors = _pythons()
    stacks = tuple(s for s in stacks if s in pythons)
    print(
        f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, fp32, fwd+bwd+AdamW (clip {CLIP}), {rounds} alternating rounds"
    )
    runs: Dict[Tuple[str, str], List[dict]] = {}
    peaks: Dict[str, float] = {}
    for r in range(rounds):
        for fw in ("paddle", "torch"):
            py = pythons["ours"] if fw == "paddle" else pythons.get("torch")
            res, err = _run(py, "peak", fw) if py else (None, "no python")
            if res:
                peaks[fw] = max(peaks.get(fw, 0.0), res["gflops"])
        for shape in shapes:
            for stack in stacks:
                t0 = time.perf_counter()
                res, err = _run(pythons[stack], stack, shape)
                if res is None:
                    errors[f"{stack}/{shape}"] = err
                    print(f"  round {r + 1} {shape:4s} {stack:13s} FAILED: {err}", flush=True)
                    continue
                runs.setdefault((shape, stack), []).append(res)
                print(
                    f"  round {r + 1} {shape:4s} {stack:13s} {res['tokens_per_sec']:8.1f} tokens/s "
                    f"(fwd {res['forward_s']:.2f} s, bwd {res['backward_s']:.2f} s, update {res['update_s']:.2f} s; "
                    f"{time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return report(runs, peaks, errors, shapes, stacks)


def report(runs: dict, peaks: Dict[str, float], errors: Dict[str, str], shapes, stacks) -> dict:
    peak = max(peaks.values()) if peaks else 0.0
    print("fp32 matmul peak (2048^3, best): " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peaks.items()))
    out: dict = {"peaks_gflops": peaks, "errors": errors, "shapes": {k: SHAPES[k] for k in shapes}}
    for shape in shapes:
        fpt = flops_per_token(SHAPES[shape])
        best = {
            s: max(runs[(shape, s)], key=lambda x: x["tokens_per_sec"]) for s in stacks if (shape, s) in runs
        }
        print(f"\n{shape}: {SHAPES[shape]}")
        print(
            "| stack | tokens/s | fwd s | bwd s | update s | MFU | vs PaddleFormers | vs torch | first loss | peak RSS MB |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for s, r in best.items():
            tps = r["tokens_per_sec"]
            mfu = tps * fpt / (peak * 1e9) if peak else 0.0
            pf = best.get("paddleformers", {}).get("tokens_per_sec")
            th = best.get("torch", {}).get("tokens_per_sec")
            print(
                f"| {s} | {tps:.1f} | {r['forward_s']:.2f} | {r['backward_s']:.2f} | {r['update_s']:.2f} | "
                f"{100 * mfu:.1f}% | {tps / pf if pf else float('nan'):.2f}x | {tps / th if th else float('nan'):.2f}x | "
                f"{r['first_loss']:.4f} | {r.get('peak_rss_mb', 0):.0f} |"
            )
            out[f"{shape}/{s}"] = dict(
                r, mfu=mfu, all_tokens_per_sec=[x["tokens_per_sec"] for x in runs[(shape, s)]]
            )
        print(
            "per timed step: "
            + "; ".join(
                f"{s} {r['page_faults_per_step']:.0f} page faults, {r['sys_s_per_step']:.2f} s kernel / "
                f"{r['user_s_per_step']:.2f} s user CPU"
                for s, r in best.items()
            )
        )
    for k, e in errors.items():
        print(f"{k}: FAILED: {e}")
    return out


SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "batch", "tied")


def parse_shape(spec: str) -> Tuple[str, dict]:
    """``NAME=layers,hidden,heads,kv_heads,ffn,vocab,seq,batch,tied`` -> (name, shape)."""
    name, _, values = spec.partition("=")
    parts = values.split(",")
    if not name or len(parts) != len(SHAPE_FIELDS) or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--shape {spec!r}: expected NAME={','.join(SHAPE_FIELDS)} (integers; tied 0 or 1)")
    shape = dict(zip(SHAPE_FIELDS, (int(p) for p in parts)), warmup=2, steps=3)
    shape["tied"] = bool(shape["tied"])
    if shape["hidden"] % shape["heads"] or shape["heads"] % shape["kv_heads"]:
        raise SystemExit(f"--shape {spec!r}: heads must divide hidden and kv_heads must divide heads")
    return name, shape


def _shape_env() -> None:
    """Shapes given on the driver's command line reach the workers through the environment."""
    for spec in filter(None, os.environ.get("BENCH_STACKS_SHAPES", "").split(";")):
        name, shape = parse_shape(spec)
        SHAPES[name] = shape


if __name__ == "__main__":
    argv = sys.argv
    if "--shape" in argv:
        specs = [argv[i + 1] for i, a in enumerate(argv) if a == "--shape"]
        for spec in specs:
            parse_shape(spec)  # refuse a bad spec before anything runs
        os.environ["BENCH_STACKS_SHAPES"] = ";".join(specs)
    _shape_env()
    if len(argv) >= 4 and argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(argv[2], argv[3])), flush=True)
    else:
        n = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 2
        sh = tuple(argv[argv.index("--shapes") + 1].split(",")) if "--shapes" in argv else tuple(SHAPES)
        st = tuple(argv[argv.index("--stacks") + 1].split(",")) if "--stacks" in argv else STACKS
        unknown = [x for x in sh if x not in SHAPES]
        if unknown:
            raise SystemExit(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
        main(n, sh, st)
