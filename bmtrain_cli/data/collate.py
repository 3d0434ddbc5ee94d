"""Truncation, padding and packing of tokenised samples into micro-batches.

A batch is a dict of int64 numpy arrays [rows, width]:
  input_ids       token ids, pad_id on padding
  labels          ids on trained tokens, -100 elsewhere; UNSHIFTED (the model predicts labels[t+1] at t).
                  The first token of every sample is -100 too: in a packed row it would otherwise be the
                  target of the previous sample's last token, and in an unpadded row it is never a target,
                  so packed and unpacked batches carry exactly the same targets.
  attention_mask  segment ids: 0 on padding, 1, 2, 3 ... for the samples of a row
  position_ids    0, 1, 2 ... restarting at every sample, 0 on padding
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.labels import IGNORE_INDEX

Sample = Tuple[np.ndarray, np.ndarray]  # (ids, trainable mask)

TRUNC_NONE, TRUNC_PROMPT, TRUNC_ANSWER = 0, 1, 2


def truncate(ids: np.ndarray, mask: np.ndarray, max_len: int, bos_id: Optional[int]) -> Tuple[Sample, int]:
    """Fit a sample into max_len tokens, keeping the answer: drop prompt tokens from the left (after BOS).

    When the answer alone does not fit, keep up to half the budget of prompt context and the answer's
    beginning. Returns ((ids, mask), TRUNC_NONE | TRUNC_PROMPT | TRUNC_ANSWER).
    """
    n = len(ids)
    if n <= max_len:
        return (ids, mask), TRUNC_NONE
    keep_head = 1 if (bos_id is not None and n and int(ids[0]) == bos_id and not mask[0]) else 0
    first = int(np.argmax(mask)) if mask.any() else n
    budget = max_len - keep_head
    if n - first <= budget:
        start = n - budget
        out_ids = np.concatenate([ids[:keep_head], ids[start:]])
        out_mask = np.concatenate([mask[:keep_head], mask[start:]])
        return (out_ids, out_mask), TRUNC_PROMPT
    prompt_len = first - keep_head
    prompt_keep = min(prompt_len, budget // 2)
    answer_keep = budget - prompt_keep
    sl_prompt = slice(first - prompt_keep, first)
    sl_answer = slice(first, first + answer_keep)
    out_ids = np.concatenate([ids[:keep_head], ids[sl_prompt], ids[sl_answer]])
    out_mask = np.concatenate([mask[:keep_head], mask[sl_prompt], mask[sl_answer]])
    return (out_ids, out_mask), TRUNC_ANSWER


def pack(order: Iterable[int], lengths: np.ndarray, max_len: int, window: int = 16) -> List[List[int]]:
    """Group samples into rows of at most max_len tokens: first fit over a window of open rows.

    Deterministic for a given order; every sample lands in exactly one row. Rows come out in the order
    they are closed (a row closes when it is full or when it is the oldest and the window is full).
    """
    rows: List[List[int]] = []
    open_rows: List[List[int]] = []
    room: List[int] = []
    for s in order:
        n = int(lengths[s])
        for i, free in enumerate(room):
            if n <= free:
                open_rows[i].append(int(s))
                room[i] -= n
                if room[i] == 0:
                    rows.append(open_rows.pop(i))
                    room.pop(i)
                break
        else:
            if len(open_rows) >= window:
                rows.append(open_rows.pop(0))
                room.pop(0)
            open_rows.append([int(s)])
            room.append(max_len - n)
            if room[-1] == 0:
                rows.append(open_rows.pop())
                room.pop()
    rows.extend(open_rows)
    return rows


def collate(
    rows: Sequence[Sequence[Sample]], pad_id: int, width: Optional[int] = None
) -> Dict[str, np.ndarray]:
    """Lay rows of samples out into a padded batch (width: fixed, or None for the longest row)."""
    lens = [sum(len(ids) for ids, _ in row) for row in rows]
    w = max(lens) if width is None else width
    if max(lens) > w:
        raise ValueError(f"row of {max(lens)} tokens does not fit width {w}")
    b = len(rows)
    input_ids = np.full((b, w), pad_id, dtype=np.int64)
    labels = np.full((b, w), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((b, w), dtype=np.int64)
    position_ids = np.zeros((b, w), dtype=np.int64)
    for r, row in enumerate(rows):
        p = 0
        for seg, (ids, mask) in enumerate(row, start=1):
            n = len(ids)
            input_ids[r, p : p + n] = ids
            labels[r, p : p + n] = np.where(np.asarray(mask, dtype=bool), ids, IGNORE_INDEX)
            labels[r, p] = IGNORE_INDEX
            attention_mask[r, p : p + n] = seg
            position_ids[r, p : p + n] = np.arange(n)
            p += n
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def empty_batch(pad_id: int) -> Dict[str, np.ndarray]:
    """A one-token batch with no target: what a data rank gets when its shard of an epoch has run out.

    It contributes 0 to both the loss sum and the token count, and keeps every rank stepping together.
    """
    one = np.array([[pad_id]], dtype=np.int64)
    return {
        "input_ids": one,
        "labels": np.full((1, 1), IGNORE_INDEX, dtype=np.int64),
        "attention_mask": np.ones((1, 1), dtype=np.int64),
        "position_ids": np.zeros((1, 1), dtype=np.int64),
    }
