"""The GRPO demo task (configs/quickstart-grpo.yaml): reverse the quickstart's strings, rewarded by exact
match, on the quickstart's strings.

``prompts_train.jsonl`` / ``prompts_heldout.jsonl`` hold ``{"prompt": "kqzfa=", "answer": "afzqk"}``;
``heldout.jsonl`` holds the held-out prompts as SFT records, for the greedy exact-match accuracy the SFT
recipe reports before and after. The held-out strings are the quickstart's held-out strings, never trained
on by SFT or here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict

from bmtrain_cli.data.demo import WORD_HELDOUT, WORD_TRAIN, _words, reverse_record
from bmtrain_cli.preference.demo import write_jsonl

GRPO_TASKS = ("reverse",)
PROMPTS_TRAIN = 4000  # of the quickstart's training strings: more than a demo run draws


def prompt_record(word: str) -> Dict[str, str]:
    rec = reverse_record(word)
    return {"prompt": rec["input"], "answer": rec["output"]}


def write_demo_prompts(out_dir: str, task: str = "reverse", seed: int = 0) -> Dict[str, str]:
    """Write prompts_train.jsonl, prompts_heldout.jsonl and heldout.jsonl under out_dir; return their paths."""
    if task not in GRPO_TASKS:
        raise ValueError(f"no GRPO demo for {task!r}; available: {', '.join(GRPO_TASKS)}")
    # the same draw as the SFT quickstart (data/demo.py, salt 1): the same held-out strings
    train, held = _words(seed * 1000 + 1, WORD_TRAIN, WORD_HELDOUT)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "prompts_train": out / "prompts_train.jsonl",
        "prompts_heldout": out / "prompts_heldout.jsonl",
        "heldout": out / "heldout.jsonl",
    }
    write_jsonl(paths["prompts_train"], [prompt_record(w) for w in train[:PROMPTS_TRAIN]])
    write_jsonl(paths["prompts_heldout"], [prompt_record(w) for w in held])
    write_jsonl(paths["heldout"], [reverse_record(w) for w in held])
    return {k: str(v) for k, v in paths.items()}
