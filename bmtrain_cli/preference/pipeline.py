"""Preference pairs through fleet's pipeline schedule (parallel_config.pipeline_parallel > 1).

Each trainer micro-batch of P pairs is one pipeline micro-batch, padded to 2 x micro_batch_size rows of
max_seq_len tokens (fleet fixes the shapes sent between stages at its first step; a padded row is padding
only, segment 0, and predicts nothing). Its labels carry what the last stage needs to turn the logits into
pair losses: at every position the next token and the sequence whose response token that is
(``sequence_index``, -1 for none), and the reference log-probs of the 2P sequences (precomputed; zeros for
the reference-free losses; a live reference model would need a second pipeline pass and is refused by
config/checks.py). The last stage returns the micro-batch's summed pair losses (PreferenceObjective.pair_loss,
the same arithmetic as one process) and records the metric sums; the pipeline step divides by the step's
pairs over the data ranks, so the gradient is one process's mean pair loss over the step. A mixture of
experts with output_router_logits adds ``router_aux_loss_coef x`` the policy forward's load-balancing loss
x the micro-batch's pairs on the last stage, from the routers' sums the stages carry (parallel/pipeline_moe.py),
as one process adds it (preference/objective.py); the padded rows are padding, left out of those sums.

Beside context parallel each rank of a context group runs its share of every row (ring_attention.split_batch
of the padded rows: next tokens shifted over the whole rows, the whole rows' mask travelling for the ring);
the last stage sums its partial sequence log-probs over the group (logps.summed_over_context, as
sequence_logps does under context parallel), and the group's first rank alone counts the
pairs, their losses and metrics.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import paddle

from bmtrain_cli.parallel.pipeline import last_stage_values
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.preference.logps import per_sequence, response_positions, summed_over_context, token_logps
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.reference import Precomputed


def _padded(arr: np.ndarray, rows: int, width: int, value: int) -> np.ndarray:
    out = np.full((rows, width), value, dtype=np.int64)
    out[: arr.shape[0], : arr.shape[1]] = arr
    return out


def _following(ids: np.ndarray) -> np.ndarray:
    """The next token at every position (0 at a row's end)."""
    following = np.zeros_like(ids)
    following[:, :-1] = ids[:, 1:]
    return following


def pipeline_rows(micro_batch_size: int) -> int:
    """Rows of every pipeline micro-batch: one per sequence when each sequence has its own row."""
    return 2 * micro_batch_size


class PairPipeline:
    """The pipeline objective (parallel/pipeline.py PipelineObjective) of stage: dpo."""

    def __init__(self, objective: PreferenceObjective, ctx: ParallelCtx, rows: int) -> None:
        if objective.reference is not None and not isinstance(objective.reference, Precomputed):
            raise ValueError(
                "pipeline parallel takes precomputed reference log-probs or a reference-free loss"
            )
        self.objective = objective
        self.ctx = ctx
        self.rows = rows

    def pipeline_data(
        self, micro_batches: Sequence[Dict[str, np.ndarray]], length: int
    ) -> Tuple[Any, Any, float]:
        """((input_ids, attention_mask, position_ids) lists, (next token, sequence index, reference
        log-probs) lists, the step's pairs over the data ranks): one entry per micro-batch."""
        padded = [self._padded_batch(b, length) for b in micro_batches]
        shares = [self.ctx.collectives.context_share(b) for b in padded]
        pairs, _ = self.objective.begin_step(shares)
        inputs: List[List[paddle.Tensor]] = [[], [], []]
        labels: List[List[paddle.Tensor]] = [[], [], []]
        for whole, share in zip(padded, shares):
            n = 2 * len(share["pair_ids"])
            if n and self.objective.reference is not None:
                ref = self.objective.reference.logps(share, n)
            else:
                ref = paddle.zeros([n], dtype="float32")
            # the ring reads the whole rows' mask; a share's tokens predict the targets shifted over them
            following = share["targets"] if "targets" in share else _following(whole["input_ids"])
            for out, arr in zip(inputs, (share["input_ids"], whole["attention_mask"], share["position_ids"])):
                out.append(paddle.to_tensor(arr))
            for out, value in zip(
                labels,
                (paddle.to_tensor(np.asarray(following)), paddle.to_tensor(share["sequence_index"]), ref),
            ):
                out.append(value)
        return tuple(inputs), tuple(labels), pairs

    def _padded_batch(self, b: Dict[str, np.ndarray], length: int) -> Dict[str, np.ndarray]:
        """The pair batch padded to the pipeline's rows x length (padding: segment 0, no label, no
        sequence)."""
        if b["input_ids"].shape[0] > self.rows or b["input_ids"].shape[1] > length:
            raise ValueError(
                f"a pair batch of shape {b['input_ids'].shape} exceeds the pipeline's {self.rows} x {length}"
            )
        fill = {"input_ids": 0, "attention_mask": 0, "position_ids": 0, "labels": -100, "sequence_index": -1}
        return {**b, **{k: _padded(b[k], self.rows, length, v) for k, v in fill.items()}}

    def loss_sum(self, logits: paddle.Tensor, labels: Any) -> Tuple[paddle.Tensor, float]:
        """(One micro-batch's summed pair losses from the last stage's logits [rows, length, vocab], its
        pairs: the weight of its load-balancing loss, which parallel/pipeline.py adds as one process does)."""
        following, index_t, ref = labels
        n = int(ref.shape[0])
        if n == 0:  # this data rank's share ran out: zero, with a graph
            return logits.sum() * 0.0, 0.0
        index = index_t.numpy()
        r, c = response_positions(index)
        if r.size:
            flat = paddle.to_tensor((r * index.shape[1] + c).astype(np.int64))
            picked = paddle.gather(logits.reshape([-1, logits.shape[-1]]), flat)
            targets = paddle.gather(following.reshape([-1]), flat)
            token = token_logps(picked, targets, self.ctx.wrapping.factory)
            logps, counts = per_sequence(token, index[r, c], n)
        else:  # a context share without response tokens: zeros, with a graph through the head
            logps = paddle.zeros([n], "float64") + logits.sum().astype("float64") * 0.0
            counts = np.zeros(n, np.float32)
        ring = self.ctx.context_ring
        lead = ring is None or ring.rank == 0
        if ring is not None:  # the whole sequences' log-probs on every rank of the group
            logps, counts = summed_over_context(logps, counts, ring)
        loss, stats = self.objective.pair_loss(
            logps, counts, ref if self.objective.reference is not None else None
        )
        if not lead:  # counted by the group's first rank (see summed_over_context)
            loss, stats = loss * 0.0, stats * 0.0
        self.objective.record(stats)
        return loss, float(n // 2) if lead else 0.0

    def step_metrics(self) -> Dict[str, float]:
        """TRL's metrics of the step (recorded on the last stage), on every rank."""
        return self.objective.step_metrics(lambda values: last_stage_values(self.ctx, values))
