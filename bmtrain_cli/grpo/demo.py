"""The GRPO demo task (``train_config.demo_data`` with stage grpo): reverse the quickstart's strings, rewarded by exact
match, on the quickstart's strings.

``prompts_train.jsonl`` / ``prompts_heldout.jsonl`` hold ``{"prompt": "kqzfa=", "answer": "afzqk"}``;
``heldout.jsonl`` holds the held-out prompts as SFT records, for the greedy exact-match accuracy the SFT
recipe reports before and after. The held-out strings are the quickstart's held-out strings, never trained
on by SFT or here.
"""

from __future__ import annotations

from typing import Dict

from bmtrain_cli.data.demo import WORD_HELDOUT, WORD_TRAIN, _words, reverse_record, write_demo_files

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
    return write_demo_files(
        out_dir,
        {
            "prompts_train": [prompt_record(w) for w in train[:PROMPTS_TRAIN]],
            "prompts_heldout": [prompt_record(w) for w in held],
            "heldout": [reverse_record(w) for w in held],
        },
    )
