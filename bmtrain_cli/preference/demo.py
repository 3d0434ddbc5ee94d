"""The preference demo task (configs/quickstart-dpo.yaml): prefer the correct reversal of a string over a
near miss, on the quickstart's strings.

``pairs_train.jsonl`` / ``pairs_heldout.jsonl`` hold ``{"prompt": "kqzfa=", "chosen": "afzqk", "rejected":
<near miss>}``; a near miss is the correct answer with two neighbouring letters swapped or one letter
replaced by another letter of the prompt (the mistakes a half-trained reverser makes). ``heldout.jsonl``
holds the held-out prompts as SFT records, for the greedy exact-match accuracy. The held-out strings are
the quickstart's held-out strings, so none of them was trained on, by SFT or here.
"""

from __future__ import annotations

import random
from typing import Dict, List

from bmtrain_cli.data.demo import WORD_HELDOUT, WORD_TRAIN, _words, reverse_record, write_demo_files

PREFERENCE_TASKS = ("reverse",)


def near_miss(answer: str, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: two neighbouring letters swapped, or one letter replaced by
    another of its letters (a different one: the result always differs from ``answer``)."""
    letters = list(answer)
    if len(set(letters)) < 2:
        return answer[:-1] + ("a" if answer[-1] != "a" else "b")
    while True:
        out = list(letters)
        i = rng.randrange(len(out) - 1)
        if rng.random() < 0.5:
            out[i], out[i + 1] = out[i + 1], out[i]
        else:
            out[i] = rng.choice([c for c in letters if c != out[i]] or ["a"])
        if out != letters:
            return "".join(out)


def preference_records(words: List[str], rng: random.Random) -> List[Dict[str, str]]:
    out = []
    for w in words:
        rec = reverse_record(w)
        out.append(
            {"prompt": rec["input"], "chosen": rec["output"], "rejected": near_miss(rec["output"], rng)}
        )
    return out


def write_demo_pairs(out_dir: str, task: str = "reverse", seed: int = 0) -> Dict[str, str]:
    """Write pairs_train.jsonl, pairs_heldout.jsonl and heldout.jsonl under out_dir; return their paths."""
    if task not in PREFERENCE_TASKS:
        raise ValueError(f"no preference demo for {task!r}; available: {', '.join(PREFERENCE_TASKS)}")
    # the same draw as the SFT quickstart (data/demo.py, salt 1): the same held-out strings
    train, held = _words(seed * 1000 + 1, WORD_TRAIN, WORD_HELDOUT)
    rng = random.Random(seed * 1000 + 7)
    return write_demo_files(
        out_dir,
        {
            "pairs_train": preference_records(train, rng),
            "pairs_heldout": preference_records(held, rng),
            "heldout": [reverse_record(w) for w in held],
        },
    )
