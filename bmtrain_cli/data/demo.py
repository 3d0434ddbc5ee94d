"""Generated demo tasks with a held-out split: the quickstart's data, made by the project itself.

Tasks (each record is JSONL ``{"input": ..., "output": ...}``):

- ``reverse``: reverse a string of five lowercase letters, ``"kqzfa="`` -> ``"afzqk"``. The quickstart task:
  with one token per character every answer letter is a copy of one prompt letter at a fixed distance, so a
  2-layer model learns it in a couple of hundred steps on a CPU.
- ``rotate``: rotate the same kind of string right by one, ``"kqzfa="`` -> ``"akqzf"``. Same alphabet and
  prompt format as ``reverse`` but a different mapping: the LoRA example fine-tunes the quickstart's
  ``reverse`` checkpoint on it, so any rise in accuracy comes from the adapters.
- ``arithmetic``: two-digit addition, ``"12+35="`` -> ``"47"`` (harder: carries; a tiny model needs far
  more steps than the quickstart gives it).

The held-out split is real: no held-out prompt occurs in the training file (for the letter tasks the held-out
strings are drawn first and excluded from the training draw; for arithmetic every pair (a, b) lies in
exactly one split), so held-out accuracy measures the learnt rule rather than memorised answers.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Tuple

TASKS = ("reverse", "rotate", "arithmetic")
HELDOUT_FRACTION = 0.05
LETTERS = string.ascii_lowercase
WORD_LEN = 5
WORD_TRAIN = 20000
WORD_HELDOUT = 500


def _arithmetic_pairs(seed: int) -> Tuple[List[Tuple[int, int]], List[Tuple[int, int]]]:
    pairs = [(a, b) for a in range(100) for b in range(100)]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    n_held = int(len(pairs) * HELDOUT_FRACTION)
    return pairs[n_held:], pairs[:n_held]


def arithmetic_record(a: int, b: int) -> dict:
    return {"input": f"{a}+{b}=", "output": str(a + b)}


def _arithmetic_records(seed: int) -> Tuple[List[dict], List[dict]]:
    train, held = _arithmetic_pairs(seed)
    return [arithmetic_record(a, b) for a, b in train], [arithmetic_record(a, b) for a, b in held]


def reverse_record(word: str) -> dict:
    return {"input": f"{word}=", "output": word[::-1]}


def rotate_record(word: str) -> dict:
    return {"input": f"{word}=", "output": word[-1] + word[:-1]}


def _words(seed: int, n_train: int, n_held: int, length: int = WORD_LEN) -> Tuple[List[str], List[str]]:
    """Random lowercase strings: n_held distinct held-out ones, then n_train training ones none of which is
    a held-out string (training strings may repeat, as in any sampled data set)."""
    rng = random.Random(seed)
    held: List[str] = []
    seen = set()
    while len(held) < n_held:
        w = "".join(rng.choice(LETTERS) for _ in range(length))
        if w not in seen:
            seen.add(w)
            held.append(w)
    train: List[str] = []
    while len(train) < n_train:
        w = "".join(rng.choice(LETTERS) for _ in range(length))
        if w not in seen:
            train.append(w)
    return train, held


def _word_task(make: Callable[[str], dict], salt: int) -> Callable[[int], Tuple[List[dict], List[dict]]]:
    def records(seed: int) -> Tuple[List[dict], List[dict]]:
        train, held = _words(seed * 1000 + salt, WORD_TRAIN, WORD_HELDOUT)
        return [make(w) for w in train], [make(w) for w in held]

    return records


_GENERATORS: Dict[str, Callable[[int], Tuple[List[dict], List[dict]]]] = {
    "reverse": _word_task(reverse_record, 1),
    "rotate": _word_task(rotate_record, 2),
    "arithmetic": _arithmetic_records,
}


def demo_records(task: str, seed: int = 0) -> Tuple[List[dict], List[dict]]:
    """(training records, held-out records) of a demo task."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown demo task {task!r}; available: {', '.join(TASKS)}")
    return _GENERATORS[task](seed)


def write_jsonl(path: Path, records: List[dict]) -> None:
    """``records`` as JSON lines at ``path``, written whole or not at all (a temporary name, renamed)."""
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    tmp.replace(path)


def write_demo_files(out_dir: str, files: Dict[str, List[dict]]) -> Dict[str, str]:
    """Each ``files`` entry as ``out_dir/<name>.jsonl`` (the directory made if needed); name -> path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / f"{name}.jsonl" for name in files}
    for name, records in files.items():
        write_jsonl(paths[name], records)
    return {k: str(v) for k, v in paths.items()}


def write_demo_data(out_dir: str, task: str = "arithmetic", seed: int = 0) -> Tuple[str, str]:
    """Write ``train.jsonl`` and ``heldout.jsonl`` of a demo task under out_dir; return their paths.

    Deterministic for a (task, seed) pair; files are written to a temporary name and renamed.
    """
    train, held = demo_records(task, seed)
    paths = write_demo_files(out_dir, {"train": train, "heldout": held})
    return paths["train"], paths["heldout"]


def demo_corpus(paths: Iterable[str]) -> List[str]:
    """The texts a quickstart tokenizer is trained on: every prompt and answer of the given JSONL files
    (SFT records' input/output, or GRPO prompt records' prompt/answer)."""
    texts: List[str] = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    texts.append(
                        rec.get("input", rec.get("prompt", "")) + rec.get("output", rec.get("answer", ""))
                    )
    return texts


def train_demo_tokenizer(out_dir: str, data_paths: Iterable[str], vocab_size: int = 300):
    """Train and save the quickstart's sentencepiece tokenizer (byte fallback, one token per character:
    the vocabulary is capped at the byte pieces + specials + one piece per printable character)."""
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    return train_sentencepiece(demo_corpus(data_paths), out_dir, vocab_size=vocab_size)
