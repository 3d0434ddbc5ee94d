"""Held-out loss of any logits function: how `bmtrain export --quantize int8` measures what INT8 costs.

Records are encoded exactly as for training (data.formats + data.encode: template, trainable mask), each
sample is run alone (no padding, so every format gives the same numbers), and the loss is the
token-weighted mean next-token cross entropy over the trainable tokens.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.labels import IGNORE_INDEX

Sample = Tuple[np.ndarray, np.ndarray]  # (input_ids [s], labels [s], unshifted, -100 = ignored)


def encode_eval_file(
    path: str,
    tokenizer: object,
    template: str = "auto",
    data_format: str = "auto",
    max_records: int = 200,
    max_len: int = 2048,
) -> List[Sample]:
    """The first ``max_records`` usable records of a JSONL/JSON file as (ids, labels); a bad record is a
    UserError naming file:line."""
    from bmtrain_cli.data.encode import encode_scored_file  # noqa: PLC0415

    samples = encode_scored_file(
        path, tokenizer, template, data_format, max_len=max_len, max_records=max_records
    )  # type: ignore[arg-type]
    if not samples:
        raise UserError(f"{path}: no record with a trainable token to evaluate")
    return samples


def next_token_loss_sum(logits: np.ndarray, labels: np.ndarray) -> Tuple[float, int]:
    """(sum of -log p(labels[t+1] | ..t), number of predicted tokens) for logits [s, vocab], labels [s]."""
    logits = np.asarray(logits, dtype=np.float64)[:-1]
    target = np.asarray(labels)[1:]
    valid = target != IGNORE_INDEX
    if not valid.any():
        return 0.0, 0
    z = logits[valid]
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    picked = logp[np.arange(len(z)), target[valid]]
    return float(-picked.sum()), int(valid.sum())


def eval_loss(logits_fn: Callable[[np.ndarray], np.ndarray], samples: List[Sample]) -> float:
    """Token-weighted mean next-token loss of ``logits_fn`` (ids [1, s] -> logits [1, s, vocab])."""
    total, count = 0.0, 0
    for ids, labels in samples:
        s, n = next_token_loss_sum(logits_fn(ids[None, :])[0], labels)
        total += s
        count += n
    return total / max(count, 1)
