"""Evaluation: token-weighted loss / perplexity over a data set, and held-out answer accuracy by greedy
decoding (the quickstart's before/after number).
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import paddle

from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.parallel.protocol import ParallelCtx


def count_targets(batch: Dict[str, np.ndarray]) -> int:
    """Tokens the model predicts in a batch, exactly as CausalLM.loss_sum counts them: position t
    predicts labels[t + 1] unless it is -100 or t, t + 1 lie in different segments."""
    labels = batch["labels"]
    valid = labels[:, 1:] != IGNORE_INDEX
    mask = batch.get("attention_mask")
    if mask is not None:
        valid &= mask[:, 1:] == mask[:, :-1]
    return int(valid.sum())


def right_padded(mask: np.ndarray) -> bool:
    """Whether every row of segment ids [b, s] is one sample followed by padding (1 ... 1 0 ... 0)."""
    return bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] <= mask[:, :-1]).all())


def to_tensors(batch: Dict[str, np.ndarray]) -> Dict[str, paddle.Tensor]:
    """The model's inputs. Rows of one sample followed by padding need no attention mask: padding comes
    after every real token and carries no target, so plain causal attention gives every real token the
    same result and the loss the same targets; such batches go without one (the mask-free kernels)."""
    keys = ["input_ids", "labels", "attention_mask", "position_ids"]
    if batch.get("attention_mask") is not None and right_padded(batch["attention_mask"]):
        keys.remove("attention_mask")
    return {k: paddle.to_tensor(batch[k]) for k in keys if batch.get(k) is not None}


@paddle.no_grad()
def eval_loss(
    model: Any,
    batches: Iterable[Dict[str, np.ndarray]],
    autocast: Any = None,
    ctx: Optional[ParallelCtx] = None,
) -> Tuple[float, int]:
    """(mean loss per predicted token, token count) over all batches (summed over data ranks)."""
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0.0
    try:
        for batch in batches:
            t = to_tensors(batch)
            if autocast is not None:
                with autocast():
                    loss_sum, n = model.loss_sum(**t)
            else:
                loss_sum, n = model.loss_sum(**t)
            total += float(loss_sum)
            count += float(n)
    finally:
        if was_training:
            model.train()
    if ctx is not None and getattr(ctx, "data_world", 1) > 1:
        total = float(ctx.all_reduce_sum(total))
        count = float(ctx.all_reduce_sum(count))
    return (total / count if count else float("nan")), int(count)


def read_records(path: str, limit: Optional[int] = None) -> List[dict]:
    out: List[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line))
                if limit is not None and len(out) >= limit:
                    break
    return out


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


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")
