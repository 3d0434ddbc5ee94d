"""The quickstart's generated task: two-digit addition, "12+35=" -> "47", with a held-out split.

Every pair (a, b) with 0 <= a, b < 100 is either in the training file or in the held-out file, never both,
so held-out accuracy measures whether the model learnt addition rather than memorised pairs. A sample is
about 10 tokens with the quickstart tokenizer (digits are single tokens), so a 2-layer model learns it in a
few hundred steps on a CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, List, Tuple

TASKS = ("arithmetic",)
HELDOUT_FRACTION = 0.05


def _arithmetic_pairs(seed: int) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    n_held = int(len(pairs) * HELDOUT_FRACTION)
    return pairs[n_held:], pairs[:n_held]


def arithmetic_record(a: int, b: int) -> dict:
    return {"input": f"{a}+{b}=", "output": str(a + b)}


def write_demo_data(out_dir: str, task: str = "arithmetic", seed: int = 0) -> Tuple[str, str]:
    """Write ``train.jsonl`` (9500 records) and ``heldout.jsonl`` (500) under out_dir; return their paths."""
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}; available: {', '.join(TASKS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held = _arithmetic_pairs(seed)
    paths = []
    for name, pairs in (("train.jsonl", train), ("heldout.jsonl", held)):
        path = out / name
        tmp = path.with_suffix(".jsonl.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for a, b in pairs:
                f.write(json.dumps(arithmetic_record(a, b)) + "\n")
        tmp.replace(path)
        paths.append(str(path))
    return paths[0], paths[1]


def demo_corpus(paths: Iterable[str]) -> List[str]:
    """The texts a quickstart tokenizer is trained on: every prompt and answer of the given JSONL files."""
    texts: List[str] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    texts.append(rec["input"] + rec["output"])
    return texts


def train_demo_tokenizer(out_dir: str, data_paths: Iterable[str], vocab_size: int = 300):
    """Train and save the quickstart's sentencepiece tokenizer (byte fallback, one token per digit)."""
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    return train_sentencepiece(demo_corpus(data_paths), out_dir, vocab_size=vocab_size)
