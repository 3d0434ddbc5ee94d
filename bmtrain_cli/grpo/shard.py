"""This rank's share of a GRPO rollout batch under data parallel (and sharding stage 1, whose ranks also
see different data), and the exchanges that make the run equal one process.

Each data rank samples, scores and computes the old/reference log-probs of its own block of the rollout
batch's rows; the results are then gathered so that every rank holds the whole batch: the advantages
(``scale_rewards: batch`` needs the global std, and TRL too computes them from the gathered rewards), the
reward and length figures, and the checkpointed buffer are those of one process. A gather is a sum over
the data ranks of a zero array with this rank's block filled in: adding zeros is exact, so the gathered
values are bit for bit the ranks' own.

Under context parallel the ranks of a context group hold the same block (they sample, score and score
again the same whole rows) and only the group's first rank (``lead``) adds it to the sums and gathers, so
each block counts once and every rank of the group holds its lead's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class DataShard:
    rank: int = 0  # this rank's index among the data ranks
    world: int = 1  # data ranks (data_parallel x sharding_parallel)
    reduce_sum: Optional[Callable[[Any], Any]] = (
        None  # ParallelCtx.collectives.all_reduce_sum (None: one data rank)
    )
    context: int = 1  # ranks of a context group, which hold the same block
    lead: bool = True  # whether this rank adds its block to the sums (its context group's first rank)

    @property
    def alone(self) -> bool:
        """Whether no other rank takes part in the sums."""
        return (self.world == 1 and self.context == 1) or self.reduce_sum is None

    def block(self, rows: int) -> slice:
        """This rank's rows of a batch of ``rows`` (rows / world of them, in rank order)."""
        n = rows // self.world
        return slice(self.rank * n, (self.rank + 1) * n)

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise float64 sum over the data ranks (the leads' values, see the module doc)."""
        values = np.asarray(values, dtype=np.float64)
        if self.alone or self.reduce_sum is None:
            return values
        import paddle

        if not self.lead:
            values = np.zeros_like(values)
        return np.asarray(self.reduce_sum(paddle.to_tensor(values)).numpy(), dtype=np.float64)

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """Every rank's ``rows`` (the same shape on each) stacked along axis 0 in rank order."""
        rows = np.asarray(rows)
        if self.alone:
            return rows
        n = rows.shape[0]
        whole = np.zeros((n * self.world,) + rows.shape[1:], dtype=np.float64)
        whole[self.rank * n : (self.rank + 1) * n] = rows
        return self.sum(whole).astype(rows.dtype)

    def gather_lists(self, seqs: Sequence[Sequence[int]]) -> List[List[int]]:
        """Every rank's token lists (the same number on each), in rank order."""
        if self.alone:
            return [list(s) for s in seqs]
        if not self.lead:  # the group's lead's lists arrive through the sums (padded to their lengths)
            seqs = [[] for _ in seqs]
        lengths = self.gather(np.asarray([len(s) for s in seqs], dtype=np.int64))
        padded = np.zeros((len(seqs), max(1, int(lengths.max()))), dtype=np.int64)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        whole = self.gather(padded)
        return [whole[i, : int(k)].tolist() for i, k in enumerate(lengths)]
