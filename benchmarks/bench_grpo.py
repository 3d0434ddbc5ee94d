"""GRPO time per optimizer step: `stage: grpo` (recipes/grpo.py) against TRL's GRPOTrainer, same weights.

One tiny LLaMA (4 layers, hidden 256, 4 / 4 heads, ffn 688, the reverse demo's tokenizer) is trained for
a few SFT steps by `bmtrain train` and exported with `bmtrain export --format hf`; both stacks start from
those weights (ours from the checkpoint, TRL from the export) and run GRPO on the same prompts (the
reverse demo's prompt file) with the same group size, completion length and settings: ``prompts x
generations`` completions per optimizer step, sampled at temperature 1.0 with a KV cache (ours: the
model's own generator; TRL: transformers' generate), the exact-match reward against the answer column,
beta 0, loss_type dapo, group-scaled advantages, AdamW, clip 1.0, one micro-batch per step, fp32 on the
CPU. A step is timed from the end of the previous optimizer step to the end of this one (rollout,
rewards, forward, backward, update), in the process itself (ours: the recipe's on_step hook; TRL: a
TrainerCallback's on_step_end); the first ``--warmup`` steps are left out and the median of the rest is
kept, best over rounds. The stacks alternate (ours, TRL, ours, TRL, ...) so load on a shared machine hits
both, each with the same OMP_NUM_THREADS / torch threads.

    OMP_NUM_THREADS=1 python benchmarks/bench_grpo.py [--rounds 2] [--steps 6] [--prompts 4]
        [--generations 8] [--completion 32] [--threads 1] [--work output/bench-grpo]

BENCH_GRPO_SFT_STEPS=N starts from N SFT steps instead of 10 (1: near-random weights, which rarely end a
completion early). On a machine shared with other work, use one thread per stack: torch's thread pool
collapses when its threads are oversubscribed.

TRL runs in the reference venv (/work/main/.venv-ref or $BENCH_TORCH_PYTHON; `make ref-venv` installs
trl); without it only our figure is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL = dict(
    hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
)
LR, SEED = 1.0e-5, 0
MAX_SEQ_LEN = 64
SFT_STEPS = int(os.environ.get("BENCH_GRPO_SFT_STEPS", "10"))  # the starting weights: SFT steps on the demo


def _bmtrain(*args: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True, cwd=REPO
    )
    if res.returncode != 0:
        raise RuntimeError(f"bmtrain {' '.join(args)} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")


def prepare(work: Path) -> Dict[str, str]:
    """The starting checkpoint (a few SFT steps on the reverse demo), its HF export and the prompts."""
    import yaml

    ckpt, hf, prompts = (
        work / "sft" / "checkpoints" / f"step-{SFT_STEPS}",
        work / f"hf-{SFT_STEPS}",
        work / "data" / "prompts_train.jsonl",
    )
    if not (hf / "model.safetensors").is_file() or not ckpt.is_dir():
        work.mkdir(parents=True, exist_ok=True)
        config = {
            "model_config": {"family": "llama", **MODEL, "max_seq_len": MAX_SEQ_LEN},
            "train_config": {
                "demo_data": "reverse",
                "output_dir": str(work / "sft"),
                "overwrite_output_dir": True,
                "max_steps": SFT_STEPS,
                "micro_batch_size": 32,
                "learning_rate": 3.0e-3,
                "save_steps": SFT_STEPS,
            },
        }
        (work / "sft.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
        _bmtrain("train", "--config", str(work / "sft.yaml"))
        _bmtrain("export", "-c", str(ckpt), "-o", str(hf), "--format", "hf", "--overwrite")
    if not prompts.is_file():
        sys.path.insert(0, str(REPO))
        from bmtrain_cli.grpo.demo import write_demo_prompts

        write_demo_prompts(str(work / "data"))
    return {"checkpoint": str(ckpt), "hf": str(hf), "prompts": str(prompts)}


# ----------------------------------------------------------------------------- the workers


def _worker_ours(a: argparse.Namespace, paths: Dict[str, str]) -> dict:
    import yaml

    sys.path.insert(0, str(REPO))
    from bmtrain_cli.config import load_config
    from bmtrain_cli.train.run import load_recipe

    out = Path(a.work) / "ours"
    config = {
        "model_config": {"model_name_or_path": paths["checkpoint"], "max_seq_len": MAX_SEQ_LEN},
        "train_config": {
            "stage": "grpo",
            "data_path": paths["prompts"],
            "output_dir": str(out),
            "overwrite_output_dir": True,
            "max_steps": a.steps,
            "micro_batch_size": a.prompts * a.generations,
            "learning_rate": LR,
            "warmup_steps": 0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "logging_steps": 1,
            "save_steps": 100000,
            "seed": SEED,
            "grpo": {
                "num_generations": a.generations,
                "max_completion_length": a.completion,
                "temperature": 1.0,
                "top_p": 1.0,
                "beta": 0.0,
                "loss_type": "dapo",
                "scale_rewards": "group",
                "reward_funcs": ["accuracy"],
            },
        },
    }
    cfg = Path(a.work) / "ours.yaml"
    cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
    stamps: List[float] = []
    lengths: List[float] = []

    def on_step(parts, state, out_step) -> None:
        stamps.append(time.perf_counter())
        lengths.append(float(out_step.metrics.get("completions/mean_length", 0.0)))

    with open(os.devnull, "w") as quiet:
        load_recipe("grpo").recipe(load_config(str(cfg)), stream=quiet, on_step=on_step)
    return {"stamps": stamps, "mean_length": lengths}


def _worker_trl(a: argparse.Namespace, paths: Dict[str, str]) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    records = [json.loads(x) for x in Path(paths["prompts"]).read_text(encoding="utf-8").splitlines() if x]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    tokenizer = AutoTokenizer.from_pretrained(paths["hf"])
    model = AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)

    def accuracy(prompts, completions, answer, **_):
        return [float(c.strip() == str(x).strip()) for c, x in zip(completions, answer)]

    stamps: List[float] = []
    lengths: List[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    config = GRPOConfig(
        output_dir=str(Path(a.work) / "trl"),
        per_device_train_batch_size=a.prompts * a.generations,
        gradient_accumulation_steps=1,
        num_generations=a.generations,
        max_completion_length=a.completion,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=SEED,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=accuracy,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Stamp()],
    )
    trainer.train()
    return {"stamps": stamps, "mean_length": lengths}


def _step_time(result: dict, warmup: int) -> Optional[float]:
    """The median time of the optimizer steps after the first ``warmup`` (from one step's end to the next)."""
    gaps = [b - a for a, b in zip(result["stamps"], result["stamps"][1:])][max(0, warmup - 1) :]
    return statistics.median(gaps) if gaps else None


# ----------------------------------------------------------------------------- the driver


def _ref_python() -> Optional[str]:
    for candidate in (
        os.environ.get("BENCH_TORCH_PYTHON"),
        "/work/main/.venv-ref/bin/python",
        str(REPO / ".venv-ref/bin/python"),
    ):
        if candidate and Path(candidate).is_file():
            probe = subprocess.run([candidate, "-c", "import trl"], capture_output=True)
            if probe.returncode == 0:
                return candidate
    return None


def _run(python: str, kind: str, a: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    args = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        kind,
        "--work",
        a.work,
        "--steps",
        str(a.steps),
    ]
    args += [
        "--prompts",
        str(a.prompts),
        "--generations",
        str(a.generations),
        "--completion",
        str(a.completion),
    ]
    res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO, timeout=3600)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(
            f"{kind} worker failed ({res.returncode}):\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--completion", type=int, default=32)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--work", default=str(REPO / "output" / "bench-grpo"))
    p.add_argument("--worker", choices=("ours", "trl"), default=None)
    return p


def main(argv: Optional[List[str]] = None) -> dict:
    a = _parser().parse_args([] if argv is None else argv)
    prepare(Path(a.work))
    ref = _ref_python()
    stacks = {"ours": sys.executable, **({"trl": ref} if ref else {})}
    best: Dict[str, float] = {}
    lengths: Dict[str, float] = {}
    for r in range(a.rounds):
        for kind, python in stacks.items():
            result = _run(python, kind, a)
            t = _step_time(result, a.warmup)
            if t is not None and t < best.get(kind, float("inf")):
                best[kind] = t
                lengths[kind] = statistics.mean(result["mean_length"]) if result["mean_length"] else 0.0
            print(
                f"round {r + 1} {kind}: {t:.3f} s/step" if t is not None else f"round {r + 1} {kind}: -",
                flush=True,
            )
    rows = a.prompts * a.generations
    print(
        f"\nGRPO, {a.prompts} prompts x {a.generations} generations = {rows} completions of up to {a.completion} "
        f"tokens per optimizer step, {a.threads} threads, median of steps {a.warmup + 1}-{a.steps}, best of {a.rounds}"
    )
    for kind, t in best.items():
        print(f"  {kind:<5} {t:8.3f} s/step   mean completion length {lengths[kind]:.1f}")
    out: Dict[str, object] = {"s_per_step": best, "mean_completion_length": lengths}
    if "trl" in best:
        out["trl_over_ours"] = best["trl"] / best["ours"]
        print(f"  TRL / ours: {out['trl_over_ours']:.2f}x")
    else:
        print("  TRL: no reference venv with trl (make ref-venv)")
    return out


if __name__ == "__main__":
    args = _parser().parse_args()
    if args.worker:
        paths = prepare(Path(args.work))
        result = (_worker_ours if args.worker == "ours" else _worker_trl)(args, paths)
        print("RESULT " + json.dumps(result), flush=True)
    else:
        main(sys.argv[1:])
