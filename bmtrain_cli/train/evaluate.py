"""Held-out answer accuracy by greedy decoding (the quickstart's before/after number). The loss and
perplexity are models/scoring.py's.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import paddle


@paddle.no_grad()
def greedy_complete(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: Optional[int],
    pad_id: int = 0,
    batch_size: int = 64,
) -> List[List[int]]:
    """Greedy continuation of each prompt (left-padded batches, full re-encoding per token: the prompts
    and answers of an evaluation set are short, so this costs little and needs no cache)."""
    was_training = model.training
    model.eval()
    results: List[List[int]] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            outs: List[List[int]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            for _ in range(max_new_tokens):
                seqs = [p + o for p, o in zip(chunk, outs)]
                width = max(len(s) for s in seqs)
                ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
                mask = np.zeros((len(seqs), width), dtype=np.int64)
                pos = np.zeros((len(seqs), width), dtype=np.int64)
                for i, s in enumerate(seqs):
                    ids[i, width - len(s) :] = s
                    mask[i, width - len(s) :] = 1
                    pos[i, width - len(s) :] = np.arange(len(s))
                logits = model(
                    paddle.to_tensor(ids),
                    attention_mask=paddle.to_tensor(mask),
                    position_ids=paddle.to_tensor(pos),
                )
                nxt = paddle.argmax(logits[:, -1, :].astype("float32"), axis=-1).numpy().tolist()
                for i, tok in enumerate(nxt):
                    if done[i]:
                        continue
                    if eos_id is not None and tok == eos_id:
                        done[i] = True
                    else:
                        outs[i].append(int(tok))
                if all(done):
                    break
            results.extend(outs)
    finally:
        if was_training:
            model.train()
    return results


def answer_accuracy(
    model: Any,
    tokenizer: Any,
    records: Sequence[dict],
    *,
    template: str = "auto",
    data_format: str = "auto",
    max_new_tokens: int = 8,
    batch_size: int = 64,
) -> Dict[str, Any]:
    """Share of records whose greedy answer equals the expected one (whitespace-stripped)."""
    from bmtrain_cli.data.encode import encode_prompt

    prompts, answers = [], []
    for rec in records:
        ids, answer = encode_prompt(rec, tokenizer, template, data_format)
        if answer is None:
            continue
        prompts.append(ids)
        answers.append(answer.strip())
    if not prompts:
        return {"accuracy": float("nan"), "n": 0, "examples": []}
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    outs = greedy_complete(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        pad_id=pad,
        batch_size=batch_size,
    )
    preds = [tokenizer.decode(o).strip() for o in outs]
    correct = sum(p == a for p, a in zip(preds, answers))
    examples = [
        {"prompt": tokenizer.decode(p), "expected": a, "got": g}
        for p, a, g in list(zip(prompts, answers, preds))[:5]
    ]
    return {"accuracy": correct / len(answers), "n": len(answers), "examples": examples}
