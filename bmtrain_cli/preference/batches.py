"""Pair truncation and pair batches.

Truncation keeps the prompt and cuts the responses: a pair longer than max_seq_len keeps its prompt whole
when the responses still get tokens, cutting both responses from the right; a prompt that would leave a
response less than half the budget keeps only its last tokens (after BOS). Both sequences of a pair keep
the same prompt tokens.

A pair batch is the SFT batch layout (data/collate.py: input_ids, labels, attention_mask = segment ids,
position_ids) over the 2P sequences of P pairs (sequence 2k chosen, 2k + 1 rejected of pair k), one per
row, or packed several to a row (batching: packed), where the segment ids keep every sequence, chosen and
rejected of one pair included, from attending to any other. Added keys:

  sequence_index  [rows, width - 1]: at position t, the sequence whose response token t + 1 is (predicted
                  there), -1 where nothing is predicted
  pair_ids        [P] global pair ids; ref_logps [P, 2] when the reference log-probs are precomputed
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.collate import collate, empty_batch, pack

Sample = Tuple[np.ndarray, np.ndarray]


def _head(ids: np.ndarray, mask: np.ndarray, bos_id: Optional[int]) -> int:
    return 1 if (bos_id is not None and len(ids) and int(ids[0]) == bos_id and not mask[0]) else 0


def truncate_pair(
    chosen: Sample, rejected: Sample, max_len: int, bos_id: Optional[int]
) -> Tuple[Sample, Sample]:
    """Fit both sequences of a pair into max_len tokens (see the module docstring)."""
    if max(len(chosen[0]), len(rejected[0])) <= max_len:
        return chosen, rejected
    head = _head(chosen[0], chosen[1], bos_id)
    first = [int(np.argmax(m)) for _, m in (chosen, rejected)]  # first response token
    prompt = first[0] - head
    longest_response = max(len(ids) - f for (ids, _), f in zip((chosen, rejected), first))
    budget = max_len - head
    response_room = max(budget - prompt, min(longest_response, budget // 2))
    prompt_keep = min(prompt, budget - response_room)
    out = []
    for (ids, mask), f in zip((chosen, rejected), first):
        keep = budget - prompt_keep
        sl = np.r_[0:head, f - prompt_keep : f, f : min(len(ids), f + keep)]
        out.append((ids[sl], mask[sl]))
    return out[0], out[1]


def sequence_index(batch: Dict[str, np.ndarray], order: Sequence[Tuple[int, int]]) -> np.ndarray:
    """[rows, width - 1]: which sequence each predicted response token belongs to (-1: none). ``order``
    gives the (row, segment id) of sequence 0, 1, 2 ..."""
    labels, seg = batch["labels"], batch["attention_mask"]
    valid = (labels[:, 1:] != -100) & (seg[:, 1:] == seg[:, :-1])
    index = np.full(valid.shape, -1, dtype=np.int64)
    for s, (row, segment) in enumerate(order):
        index[row][valid[row] & (seg[row, 1:] == segment)] = s
    return index


def collate_pairs(
    pairs: Sequence[Tuple[Sample, Sample]],
    pad_id: int,
    *,
    width: Optional[int],
    packed: bool,
    max_len: int,
) -> Dict[str, np.ndarray]:
    """A pair batch (module docstring). ``width`` None pads to the longest row; packed rows are at most
    max_len wide."""
    if not pairs:
        batch = empty_batch(pad_id)
        batch["sequence_index"] = np.full((1, 0), -1, dtype=np.int64)
        return batch
    seqs: List[Sample] = [s for pair in pairs for s in pair]
    if packed:
        lengths = np.asarray([len(ids) for ids, _ in seqs])
        rows_of = pack(list(range(len(seqs))), lengths, max_len)
    else:
        rows_of = [[i] for i in range(len(seqs))]
    where: Dict[int, Tuple[int, int]] = {}
    for r, members in enumerate(rows_of):
        for k, s in enumerate(members, start=1):
            where[s] = (r, k)
    batch = collate([[seqs[s] for s in members] for members in rows_of], pad_id, width)
    batch["sequence_index"] = sequence_index(batch, [where[s] for s in range(len(seqs))])
    return batch
