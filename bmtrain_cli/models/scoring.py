"""Scoring a JSONL file with a model: mean token loss and perplexity (``bmtrain eval``).

Instruction records ({"input","output"}, alpaca, chat) are scored on the answer tokens only; plain
{"text": ...} records on all their tokens. Records are encoded with the data package's templates, so
the numbers mean the same as the trainer's eval loss.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import numpy as np
import paddle

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.decoder import CausalLM


def encode_file(
    path: str,
    tokenizer: Any,
    template: str = "auto",
    data_format: str = "auto",
    max_seq_len: int = 2048,
) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(input ids, unshifted labels with -100 on unscored tokens) per record; a bad record is a
    UserError naming file:line. Records longer than ``max_seq_len`` keep their last tokens."""
    from bmtrain_cli.data.encode import labels_from_mask, make_encoder
    from bmtrain_cli.data.formats import BadRecord, parse_record
    from bmtrain_cli.data.readers import read_records

    encoder = make_encoder(tokenizer, template)
    out = []
    for rec in read_records(path):
        if rec.error:
            raise UserError(f"{rec.where()}: {rec.error}")
        try:
            conv = parse_record(rec.value, data_format)
        except BadRecord as exc:
            raise UserError(f"{rec.where()}: {exc}") from None
        ids, mask = encoder.encode(conv)
        ids, mask = ids[-max_seq_len:], mask[-max_seq_len:]
        labels = labels_from_mask(ids, mask)
        if (labels[1:] != -100).sum() == 0:
            continue  # nothing to score (e.g. the answer was truncated away)
        out.append((np.asarray(ids, dtype=np.int64), labels))
    return out


@paddle.no_grad()
def score(
    model: CausalLM, samples: List[Tuple[np.ndarray, np.ndarray]], batch_size: int = 8
) -> Dict[str, Any]:
    """Token-weighted mean loss over all samples: {"loss", "ppl", "tokens", "records"}."""
    model.eval()
    total, count = 0.0, 0.0
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))  # less padding
    for start in range(0, len(order), batch_size):
        batch = [samples[i] for i in order[start : start + batch_size]]
        width = max(len(ids) for ids, _ in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        labels = np.full((len(batch), width), -100, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for r, (i, lab) in enumerate(batch):
            ids[r, : len(i)], labels[r, : len(i)], mask[r, : len(i)] = i, lab, 1
        s, c = model.loss_sum(
            paddle.to_tensor(ids), paddle.to_tensor(labels), attention_mask=paddle.to_tensor(mask)
        )
        total += float(s)
        count += float(c)
    if count == 0:
        raise UserError("no tokens to score (every record is empty after encoding)")
    loss = total / count
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "tokens": int(count), "records": len(samples)}
