"""Summed log-probs of each sequence's response tokens, from one forward over a pair batch.

Only the positions that predict a response token go through the LM head (the hidden states are gathered
first), so the logits held are [response tokens, vocab] rather than [rows x width, vocab]. Under tensor
parallelism the vocabulary-split cross entropy of fleet gives the per-token values.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F

from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.models.scoring import right_padded


def model_inputs(batch: Dict[str, np.ndarray]) -> Dict[str, paddle.Tensor]:
    """input_ids, position_ids and (unless every row is one right-padded sequence) the segment ids."""
    out = {
        "input_ids": paddle.to_tensor(batch["input_ids"]),
        "position_ids": paddle.to_tensor(batch["position_ids"]),
    }
    if not right_padded(batch["attention_mask"]):
        out["attention_mask"] = paddle.to_tensor(batch["attention_mask"])
    return out


def token_logps(
    logits: paddle.Tensor, targets: paddle.Tensor, factory: Optional[LayerFactory]
) -> paddle.Tensor:
    """log p(target) per row of ``logits`` [tokens, vocab] (a vocabulary shard under tensor parallel)."""
    logits = logits.astype("float32")
    if factory is not None and factory.tp_degree > 1:
        from paddle.distributed.fleet.meta_parallel import ParallelCrossEntropy

        return -ParallelCrossEntropy(mp_group=factory.mp_group)(logits, targets.reshape([-1, 1])).reshape(
            [-1]
        )
    return -F.cross_entropy(logits, targets.reshape([-1, 1]), reduction="none").reshape([-1])


def response_positions(index: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of the positions that predict a response token (``sequence_index`` >= 0)."""
    rows, cols = np.nonzero(index >= 0)
    return rows, cols


def per_sequence(
    token: paddle.Tensor, sequence_of_token: np.ndarray, n_sequences: int
) -> Tuple[paddle.Tensor, np.ndarray]:
    """(summed ``token`` values [n_sequences], token counts [n_sequences]).

    The sum runs as a product with a 0/1 [sequences, tokens] matrix: differentiable, and the same
    arithmetic whatever rows the sequences were packed into."""
    counts = np.bincount(sequence_of_token, minlength=n_sequences).astype(np.float32)
    member = np.zeros((n_sequences, len(sequence_of_token)), dtype=np.float32)
    member[sequence_of_token, np.arange(len(sequence_of_token))] = 1.0
    return paddle.matmul(paddle.to_tensor(member), token), counts


def sequence_logps(
    model: Any, batch: Dict[str, np.ndarray], n_sequences: int
) -> Tuple[paddle.Tensor, np.ndarray]:
    """(summed response log-probs [n_sequences] fp32, response token counts [n_sequences]) of a pair batch."""
    index = batch["sequence_index"]
    hidden = model.hidden_states(**model_inputs(batch))
    rows, width = batch["input_ids"].shape
    r, c = response_positions(index)
    flat = paddle.to_tensor((r * width + c).astype(np.int64))
    picked = paddle.gather(hidden.reshape([rows * width, -1]), flat)
    targets = paddle.to_tensor(batch["input_ids"][r, c + 1].astype(np.int64))
    token = token_logps(model.logits_from_hidden(picked), targets, getattr(model, "factory", None))
    return per_sequence(token, index[r, c], n_sequences)
