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

from bmtrain_cli.errors import UserError
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
    """(summed ``token`` values [n_sequences] fp64, token counts [n_sequences]).

    The sum runs as a product with a 0/1 [sequences, tokens] matrix: differentiable, and the same
    arithmetic whatever rows the sequences were packed into. It is kept in fp64: a long response's
    log-prob is thousands of nats, where one fp32 ulp (1e-3 at 1e4) is the size of the policy-reference
    differences the pair losses take, and a sum in another order (a context-parallel rank's part)
    would round differently."""
    counts = np.bincount(sequence_of_token, minlength=n_sequences).astype(np.float32)
    member = np.zeros((n_sequences, len(sequence_of_token)), dtype=np.float64)
    member[sequence_of_token, np.arange(len(sequence_of_token))] = 1.0
    return paddle.matmul(paddle.to_tensor(member), token.astype("float64")), counts


def sequence_logps(
    model: Any, batch: Dict[str, np.ndarray], n_sequences: int
) -> Tuple[paddle.Tensor, np.ndarray]:
    """(summed response log-probs [n_sequences] fp64, response token counts [n_sequences]) of a pair batch.

    A context-parallel share (parallel/ring_attention.split_batch: ``targets`` shifted over the whole
    rows) runs the ring; its partial sums are summed over the context group (:class:`ContextSum`, whose
    gradient reaches every rank's partial), so every rank of the group returns the whole sequences'."""
    index = batch["sequence_index"]
    share = "targets" in batch
    hidden = model.hidden_states(**(share_inputs(model, batch) if share else model_inputs(batch)))
    rows, width = batch["input_ids"].shape
    r, c = response_positions(index)
    if r.size:
        flat = paddle.to_tensor((r * width + c).astype(np.int64))
        picked = paddle.gather(hidden.reshape([rows * width, -1]), flat)
        targets = batch["targets"][r, c] if share else batch["input_ids"][r, c + 1]
        token = token_logps(
            model.logits_from_hidden(picked),
            paddle.to_tensor(targets.astype(np.int64)),
            getattr(model, "factory", None),
        )
        logps, counts = per_sequence(token, index[r, c], n_sequences)
    else:  # a share without response tokens
        logps = paddle.zeros([n_sequences], "float64") + graph_zero(model, hidden)
        counts = np.zeros(n_sequences, np.float32)
    if not share:
        return logps, counts
    return summed_over_context(logps, counts, model.context_attention.ring)


def summed_over_context(
    logps: paddle.Tensor, counts: np.ndarray, ring: Any
) -> Tuple[paddle.Tensor, np.ndarray]:
    """The whole sequences' log-probs and response token counts from a context-parallel share's partial
    ones, on every rank of the group (``ring``): the log-probs through ContextSum, whose gradient reaches
    every rank's partial."""
    from bmtrain_cli.parallel.ring_attention import ContextSum

    whole = ring.all_reduce(paddle.to_tensor(counts)).numpy()
    return ContextSum.apply(logps, ring), whole


def graph_zero(model: Any, hidden: paddle.Tensor) -> paddle.Tensor:
    """0.0 (float64, shape [1]) computed from one position of ``hidden`` through the LM head, for a
    context-parallel share that scores nothing: its backward still runs the group's collectives and gives
    every parameter a gradient (the head's backward fails on an empty row, so one row goes through it)."""
    one = hidden.reshape([-1, hidden.shape[-1]])[:1]
    return model.logits_from_hidden(one).sum().astype("float64").reshape([1]) * 0.0


def share_inputs(model: Any, batch: Dict[str, np.ndarray]) -> Dict[str, Any]:
    """hidden_states' inputs of a context-parallel share: its tokens and positions, and the ring with the
    whole rows' segment ids (None: right-padded rows, causal)."""
    from bmtrain_cli.models.attention import ContextShard

    if model.context_attention is None:
        raise UserError("a context-parallel share reached a model without a context group")
    seg = batch.get("segment_ids")
    return {
        "input_ids": paddle.to_tensor(batch["input_ids"]),
        "attention_mask": ContextShard(
            model.context_attention, None if seg is None else paddle.to_tensor(seg)
        ),
        "position_ids": paddle.to_tensor(batch["position_ids"]),
    }
