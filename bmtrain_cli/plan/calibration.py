"""Check the CPU memory estimate against real `bmtrain train` runs.

Each case is a small config (sizes, sequence lengths, batch sizes, recompute off/attention/full/partial,
batching modes, accumulation, offload, LoRA, reference kernels, context and expert parallel) trained for a few steps by
`bmtrain train` in its own process (`bmtrain run` for context and expert parallel: rank 0's summary); summary.json's ``peak_memory_bytes`` (the peak of Paddle's allocator since the model
started to be built) is compared with :func:`bmtrain_cli.plan.estimator.estimate`, which is what
`bmtrain plan --config <case> --device cpu` prints (tokenizer and data read as the trainer reads them).
The cases run ``kernels: auto`` as users do: a new shape's first run times the ops and records the choice
(ops/choice.py), and the estimate, made after the run, counts that recorded choice. Used by
tests/unit/plan/test_calibration.py and `python -m bmtrain_cli.plan.calibration [work_dir [case ...]]`
(the table in docs/plan.md).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

GRPO_CASE = {
    "stage": "grpo",
    "grpo": {
        "num_generations": 8,
        "max_completion_length": 240,
        "num_iterations": 2,
        "reward_funcs": ["accuracy"],
    },
}

MOE_CASE = {"family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256}
MOE_LORA = {"finetuning": "lora", "lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}

# name: (hidden, intermediate, layers, heads, kv_heads, max_seq_len, micro_batch, recompute granularity)
# and overrides of model_config / train_config / parallel_config. The "varied" cases train on records of
# 3-120 words (batching longest: the batch width follows the data, not max_seq_len).
CASES: Dict[str, tuple] = {
    "h256-l2-s256-b4": (256, 688, 2, 4, 4, 256, 4, "none", {}),
    "h256-l2-s256-b4-full": (256, 688, 2, 4, 4, 256, 4, "full", {}),
    "h384-l3-s128-b8-gqa": (384, 1024, 3, 6, 2, 128, 8, "none", {}),
    "h512-l2-s256-b4-full": (512, 1376, 2, 8, 8, 256, 4, "full", {}),
    "h128-l4-s512-b8": (128, 344, 4, 4, 2, 512, 8, "none", {}),
    "h512-l4-s128-b2": (512, 1376, 4, 8, 8, 128, 2, "none", {}),
    "h256-l4-s512-b4-attn": (256, 688, 4, 4, 4, 512, 4, "attention", {}),
    "h768-l2-s64-b16": (768, 2048, 2, 12, 12, 64, 16, "none", {}),
    "h192-l3-s384-b4-longest": (192, 512, 3, 6, 2, 384, 4, "none", {"train": {"batching": "longest"}}),
    "h192-l3-s256-b4-packed-qwen2": (
        192,
        512,
        3,
        6,
        2,
        256,
        4,
        "none",
        {"model": {"family": "qwen2"}, "train": {"batching": "packed"}},
    ),
    "h192-l3-s256-b2-accum4": (192, 512, 3, 6, 2, 256, 2, "none", {"train": {"global_batch_size": 8}}),
    "h192-l3-s256-b4-offload": (192, 512, 3, 6, 2, 256, 4, "none", {"parallel": {"offload_optimizer": True}}),
    "h192-l3-s256-b4-lora": (
        192,
        512,
        3,
        6,
        2,
        256,
        4,
        "none",
        {"train": {"finetuning": "lora", "lora_rank": 16, "lora_target_modules": "all-linear"}},
    ),
    "h192-l3-s256-b4-reference": (192, 512, 3, 6, 2, 256, 4, "none", {"model": {"kernels": "reference"}}),
    "h128-l6-s512-b4-partial": (128, 344, 6, 4, 4, 512, 4, "full", {"train": {"recompute_num_layers": 3}}),
    "h128-l2-s1024-b2-attn-mqa": (128, 352, 2, 4, 1, 1024, 2, "attention", {}),
    # Qwen3.5 dense, fresh: three Gated DeltaNet layers (the family's 16 key / 32 value heads of 128) and
    # one gated full-attention layer; the linear layers' chunk matrices and states dominate the activations
    "h128-l4-s128-b4-qwen3_5": (
        128,
        344,
        4,
        4,
        2,
        128,
        4,
        "none",
        {"model": {"family": "qwen3_5_text", "head_dim": 32}},
    ),
    # mixture of experts (qwen3_moe, every layer sparse): 8 experts top 2 on the grouped GEMM; the same with
    # LoRA on the attention and with the reference composition (per-expert matmuls)
    "h192-l3-s256-b4-moe": (192, 512, 3, 6, 2, 256, 4, "none", {"model": MOE_CASE}),
    "h192-l3-s256-b4-moe-lora": (192, 512, 3, 6, 2, 256, 4, "none", {"model": MOE_CASE, "train": MOE_LORA}),
    "h192-l3-s128-b8-moe-reference": (
        192,
        512,
        3,
        6,
        2,
        128,
        8,
        "none",
        {"model": {**MOE_CASE, "kernels": "reference"}},
    ),
    # stage grpo: 8 completions of one demo prompt per step, full fine-tuning, the old policy's log-probs
    # (num_iterations 2): the rollout phase beside the step
    "h256-l2-s256-b8-grpo": (256, 688, 2, 4, 2, 256, 8, "none", {"train": GRPO_CASE}),
    # the same under context parallel 2 (`bmtrain run`, rank 0's peak): whole rows sampled on both ranks, the
    # old policy's log-probs and the step on each rank's share
    "h256-l2-s256-b8-grpo-cp2": (
        256,
        688,
        2,
        4,
        2,
        256,
        8,
        "none",
        {"train": GRPO_CASE, "parallel": {"context_parallel": 2}},
    ),
    # context parallel (`bmtrain run`, rank 0's peak): rows of 4096 tokens split over 2 and 4 ranks
    "h192-l2-s4096-b1-cp2": (192, 512, 2, 6, 2, 4096, 1, "none", {"parallel": {"context_parallel": 2}}),
    "h192-l2-s4096-b1-cp4-full": (192, 512, 2, 6, 2, 4096, 1, "full", {"parallel": {"context_parallel": 4}}),
    # the ulysses mode: the same rows, heads and sequence traded by an all-to-all around the fused kernel
    "h192-l2-s4096-b1-cp2-ulysses": (
        192,
        512,
        2,
        6,
        2,
        4096,
        1,
        "none",
        {"parallel": {"context_parallel": 2, "context_parallel_mode": "ulysses"}},
    ),
    # expert parallel (`bmtrain run`, rank 0's peak): the mixture of experts above, its experts split over 2
    # ranks (4 of 8 each), the routed rows sent to their owners and back by all-to-all
    "h192-l3-s256-b4-moe-ep2": (
        192,
        512,
        3,
        6,
        2,
        256,
        4,
        "none",
        {"model": MOE_CASE, "parallel": {"expert_parallel": 2}},
    ),
}


def case_config(
    name: str, work: Path, data: Dict[str, str], tokenizer: str, steps: int = 3
) -> Dict[str, Any]:
    h, inter, layers, heads, kv, seq, mb, rec, extra = CASES[name]
    config: Dict[str, Any] = {
        "model_config": {
            "family": "llama",
            "tokenizer_path": tokenizer,
            "hidden_size": h,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "max_seq_len": seq,
        },
        "train_config": {
            "data_path": data["demo"],
            "output_dir": str(work / name),
            "overwrite_output_dir": True,
            "max_steps": steps,
            "micro_batch_size": mb,
            "batching": "max_length",
            "learning_rate": 1.0e-3,
            "logging_steps": 1,
            "save_steps": 1000,
            "gradient_checkpointing": rec != "none",
            "recompute_granularity": rec if rec != "none" else "full",
            "host_memory": "release",  # RSS ~= the live tensors, so the RSS column means the same in every case
        },
    }
    if extra.get("train", {}).get("batching", "max_length") != "max_length":
        config["train_config"]["data_path"] = data["varied"]
    if extra.get("train", {}).get("stage") == "grpo":
        config["train_config"]["data_path"] = data["prompts"]
    for section in ("model", "train", "parallel"):
        if extra.get(section):
            config.setdefault(f"{section}_config", {}).update(extra[section])
    return config


def _varied_records(n: int = 600, seed: int = 0) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()
    return [
        {
            "input": " ".join(rng.choice(words) for _ in range(rng.randint(3, 60))),
            "output": " ".join(rng.choice(words) for _ in range(rng.randint(2, 60))),
        }
        for _ in range(n)
    ]


def prepare(work: Path) -> tuple:
    """Data (the demo task, and records of varied length) and a tokenizer shared by the cases."""
    from bmtrain_cli.data.demo import write_demo_data
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    work.mkdir(parents=True, exist_ok=True)
    train, _ = write_demo_data(str(work / "data"))
    prompts = work / "data" / "prompts.jsonl"  # the GRPO case's prompt records (no eval set: the steps alone)
    with open(train, encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(2000), f)]
    prompts.write_text(
        "".join(json.dumps({"prompt": r["input"], "answer": r["output"]}) + "\n" for r in rows),
        encoding="utf-8",
    )
    varied = work / "data" / "varied.jsonl"
    records = _varied_records()
    varied.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer_config.json").exists():
        texts = [r["input"] + " " + r["output"] for r in records]
        with open(train, encoding="utf-8") as f:
            for i, line in enumerate(f):
                rec = json.loads(line)
                texts.append(rec["input"] + " " + rec["output"])
                if i > 3000:
                    break
        train_sentencepiece(texts, str(tok_dir), vocab_size=256)
    return {"demo": train, "varied": str(varied), "prompts": str(prompts)}, str(tok_dir)


def run_case(
    name: str, work: Path, data: Dict[str, str], tokenizer: str, timeout: float = 900
) -> Dict[str, Any]:
    """Train one case in a subprocess; return predicted and measured peaks (bytes)."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.estimator import estimate

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(case_config(name, work, data, tokenizer)), encoding="utf-8")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    degrees = [n for n in CASES[name][8].get("parallel", {}).values() if isinstance(n, int)]
    launch = "run" if any(n > 1 for n in degrees) else "train"
    proc = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", launch, "--config", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: bmtrain {launch} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text(encoding="utf-8"))
    # the estimate `bmtrain plan --config <case> --device cpu` prints: tokenizer and data read as the trainer will
    est = estimate(load_config(str(cfg_path)).config, "cpu")
    measured = int(summary["peak_memory_bytes"])
    return {
        "case": name,
        "predicted": est.peak,
        "measured": measured,
        "error": est.peak / measured - 1.0,
        "source": summary.get("peak_memory_source"),
        "process_rss": int(summary.get("peak_rss_bytes", 0)),
        "parameters": est.total_parameters,
    }


def run(work: Path, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    data, tokenizer = prepare(work)
    return [run_case(n, work, data, tokenizer) for n in (names or list(CASES))]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    work = Path(argv[0] if argv else "output/plan-calibration")
    rows = run(work, argv[1:] or None)
    print(f"{'case':<30} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7} {'process RSS MiB':>16}")
    for r in rows:
        print(
            f"{r['case']:<30} {r['predicted'] / 2**20:>14.1f} {r['measured'] / 2**20:>13.1f} "
            f"{100 * r['error']:>+6.1f}% {r['process_rss'] / 2**20:>16.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
