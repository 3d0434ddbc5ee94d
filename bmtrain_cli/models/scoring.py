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
