"""Held-out answer accuracy by greedy decoding (the quickstart's before/after number). The loss and
perplexity are models/scoring.py's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.models.generate import generate


def greedy_complete(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: Optional[int],
    batch_size: int = 64,
    give_up: Optional[Callable[[int, List[int]], bool]] = None,
) -> List[List[int]]:
    """Greedy continuation of each prompt, without its ``eos_id``: models/generate.generate (KV-cached,
    left-padded batches of ``batch_size``), which stops at ``eos_id``, after ``max_new_tokens`` or where the
    model's positions end; and a row stops after the token for which ``give_up(prompt index, its tokens so
    far)`` is true."""
    results: List[List[int]] = []
    for start in range(0, len(prompts), batch_size):
        so_far: Dict[int, List[int]] = {}

        def on_token(row: int, token: int, start: int = start, so_far: Dict[int, List[int]] = so_far) -> bool:
            so_far.setdefault(row, []).append(token)
            return give_up is not None and give_up(start + row, so_far[row])

        chunk = prompts[start : start + batch_size]
        greedy = SamplingOptions(max_new_tokens=max_new_tokens, eos_token_id=eos_id)
        outs = generate(model, chunk, greedy, on_token=on_token)
        results.extend(o[:-1] if eos_id is not None and o and o[-1] == eos_id else o for o in outs)
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
    """Share of records whose greedy answer equals the expected one (whitespace-stripped). A record's
    decoding stops as soon as its text can no longer become the expected answer (the text so far, less an
    unfinished character, is not a start of it), so ``got`` in the examples ends at the first wrong
    token."""
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

    def cannot_match(i: int, tokens: List[int]) -> bool:
        return not answers[i].startswith(tokenizer.decode(tokens).rstrip("\ufffd").strip())

    outs = greedy_complete(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        batch_size=batch_size,
        give_up=cannot_match,
    )
    preds = [tokenizer.decode(o).strip() for o in outs]
    correct = sum(p == a for p, a in zip(preds, answers))
    examples = [
        {"prompt": tokenizer.decode(p), "expected": a, "got": g}
        for p, a, g in list(zip(prompts, answers, preds))[:5]
    ]
    return {"accuracy": correct / len(answers), "n": len(answers), "examples": examples}
