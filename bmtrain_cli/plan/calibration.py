"""Check the CPU memory estimate against real `bmtrain train` runs.

Each case is a small config (sizes, sequence lengths, recompute on/off, batch sizes) trained for a few
steps in its own process; summary.json's ``peak_memory_bytes`` (peak RSS minus the RSS before the model
is built) is compared with :func:`bmtrain_cli.plan.estimator.estimate` for the same config and the
tokenizer's vocabulary. Used by tests/unit/plan/test_calibration.py and `python -m
bmtrain_cli.plan.calibration` (the table in docs/plan.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

# name: (hidden, intermediate, layers, heads, kv_heads, max_seq_len, micro_batch, recompute granularity)
CASES: Dict[str, tuple] = {
    "h256-l2-s256-b4": (256, 688, 2, 4, 4, 256, 4, "none"),
    "h256-l2-s256-b4-full": (256, 688, 2, 4, 4, 256, 4, "full"),
    "h384-l3-s128-b8-gqa": (384, 1024, 3, 6, 2, 128, 8, "none"),
    "h512-l2-s256-b4-full": (512, 1376, 2, 8, 8, 256, 4, "full"),
    "h128-l4-s512-b8": (128, 344, 4, 4, 2, 512, 8, "none"),
    "h512-l4-s128-b2": (512, 1376, 4, 8, 8, 128, 2, "none"),
    "h256-l4-s512-b4-attn": (256, 688, 4, 4, 4, 512, 4, "attention"),
    "h768-l2-s64-b16": (768, 2048, 2, 12, 12, 64, 16, "none"),
}


def case_config(name: str, work: Path, data: str, tokenizer: str, steps: int = 3) -> Dict[str, Any]:
    h, inter, layers, heads, kv, seq, mb, rec = CASES[name]
    return {
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
            "data_path": data,
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
        },
    }


def prepare(work: Path) -> tuple:
    """Demo data and a tokenizer shared by the cases."""
    from bmtrain_cli.data.demo import write_demo_data
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    work.mkdir(parents=True, exist_ok=True)
    train, _ = write_demo_data(str(work / "data"))
    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer_config.json").exists():
        texts = []
        with open(train, encoding="utf-8") as f:
            for i, line in enumerate(f):
                rec = json.loads(line)
                texts.append(rec["input"] + " " + rec["output"])
                if i > 3000:
                    break
        train_sentencepiece(texts, str(tok_dir), vocab_size=256)
    return train, str(tok_dir)


def run_case(name: str, work: Path, data: str, tokenizer: str, timeout: float = 900) -> Dict[str, Any]:
    """Train one case in a subprocess; return predicted and measured peaks (bytes)."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.plan.estimator import estimate, training_arch

    cfg_path = work / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(case_config(name, work, data, tokenizer)), encoding="utf-8")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: bmtrain train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((work / name / "summary.json").read_text(encoding="utf-8"))
    config = load_config(str(cfg_path)).config
    vocab = load_tokenizer(tokenizer).vocab_size
    est = estimate(config, "cpu", arch=training_arch(config, vocab))
    measured = int(summary["peak_memory_bytes"])
    return {
        "case": name,
        "predicted": est.peak,
        "measured": measured,
        "error": est.peak / measured - 1.0,
        "parameters": est.total_parameters,
    }


def run(work: Path, names: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    data, tokenizer = prepare(work)
    return [run_case(n, work, data, tokenizer) for n in (names or list(CASES))]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    work = Path(argv[0] if argv else "output/plan-calibration")
    rows = run(work, argv[1:] or None)
    print(f"{'case':<24} {'predicted MiB':>14} {'measured MiB':>13} {'error':>7}")
    for r in rows:
        print(
            f"{r['case']:<24} {r['predicted'] / 2**20:>14.1f} {r['measured'] / 2**20:>13.1f} {100 * r['error']:>+6.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
