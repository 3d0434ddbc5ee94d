"""The preference data loader: pair stores -> seeded epoch order over pairs -> data-parallel shard ->
micro-batches of ``micro_batch_size`` pairs (2 x micro_batch_size sequences).

Order, sharding and resume follow the SFT loader (data/loader.py): the epoch order is a seeded permutation
of the usable pairs, each step takes a block of micro_batch_size x data_world pairs, rank r takes the block's
pairs r, r + world, ..., and the position is ``(epoch, offset)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.loader import data_sources
from bmtrain_cli.data.readers import resolve_source
from bmtrain_cli.data.store_set import BatchOptions, StoreLoader, StoreSet
from bmtrain_cli.errors import UserError
from bmtrain_cli.preference.batches import Sample, collate_pairs, truncate_pair
from bmtrain_cli.preference.pairs import open_or_build_pairs


@dataclass
class PairDataset(StoreSet):
    """The pairs of every source file; global pair id = position in the concatenation."""

    def __post_init__(self) -> None:
        sizes = [len(s) // 2 for s in self.stores]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        lens = [s.lengths.reshape(-1, 2) for s in self.stores]
        self.lengths = np.concatenate(lens) if lens else np.zeros((0, 2), np.int64)  # [pairs, 2]
        self.ref_logps: Optional[np.ndarray] = None  # [pairs, 2] once precomputed

    def __len__(self) -> int:
        return int(self.starts[-1])

    def pair(self, gid: int) -> Tuple[Sample, Sample]:
        k = int(np.searchsorted(self.starts, gid, side="right")) - 1
        i = 2 * (gid - int(self.starts[k]))
        out = []
        for j in (i, i + 1):
            ids, mask = self.stores[k].sample(j)
            out.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)))
        return out[0], out[1]


def load_pairs(
    sources: List[str],
    encoder: Any,
    *,
    on_bad_record: str = "error",
    cache_dir: Optional[str] = None,
    output_dir: Optional[str] = None,
) -> PairDataset:
    """Validate and tokenise (or reuse the cache of) every preference file; the first bad record is a
    ``file:line: reason`` error unless on_bad_record is skip."""
    files = [f for spec in sources for f in resolve_source(spec)]
    ds = PairDataset([open_or_build_pairs(f, encoder, cache_dir, output_dir) for f in files])
    ds.refuse_bad_records(on_bad_record)
    bad = ds.rejected_count
    if len(ds) == 0:
        raise UserError(
            f"no usable preference pair in {', '.join(files)}" + (f" ({bad} rejected)" if bad else "")
        )
    return ds


class PreferenceLoader(StoreLoader[PairDataset]):
    """Micro-batches of pairs for one data rank; resumable like the SFT loader (the pair order does not
    depend on batching: packing only places a batch's sequences in rows)."""

    ORDER_KEYS = ("seed",)
    DATA_NAME = "preference data"

    def __init__(self, dataset: PairDataset, options: BatchOptions):
        super().__init__(dataset, options)
        longest = dataset.lengths.max(axis=1) if len(dataset) else np.zeros(0, np.int64)
        over = longest > self.max_seq_len
        self.n_overlong = int(over.sum())
        self._usable = np.nonzero(~over if self.truncation == "drop" else np.ones(len(dataset), bool))[0]
        if len(self._usable) == 0:
            raise UserError(
                f"every preference pair is longer than max_seq_len {self.max_seq_len} and truncation is 'drop'"
            )
        self._longest = int(min(longest[self._usable].max(), self.max_seq_len))

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self._usable
        return np.random.default_rng([self.seed, epoch]).permutation(self._usable)

    def __len__(self) -> int:
        return -(-len(self._usable) // (self.micro_batch_size * self.data_world))

    @property
    def longest(self) -> int:
        return self._longest

    def pair(self, gid: int) -> Tuple[Sample, Sample]:
        chosen, rejected = self.dataset.pair(gid)
        return truncate_pair(chosen, rejected, self.max_seq_len, self.bos_id)

    def batch_of(self, gids: np.ndarray) -> Dict[str, np.ndarray]:
        """The pair batch of these global pair ids (module docstring of batches.py)."""
        packed = self.batching == "packed"
        width = self.max_seq_len if self.batching == "max_length" else None
        batch = collate_pairs(
            [self.pair(int(g)) for g in gids],
            self.pad_id,
            width=width,
            packed=packed,
            max_len=self.max_seq_len,
        )
        batch["pair_ids"] = np.asarray(gids, dtype=np.int64)
        if self.dataset.ref_logps is not None:
            batch["ref_logps"] = self.dataset.ref_logps[np.asarray(gids, dtype=np.int64)].reshape(-1, 2)
        return batch

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        if not self.infinite:
            self.epoch, self._offset = 0, 0
        step = self.micro_batch_size * self.data_world
        while True:
            order = self._order(self.epoch)
            if self._offset >= len(order):
                if not self.infinite:
                    return
                self.epoch, self._offset = self.epoch + 1, 0
                continue
            block = order[self._offset : self._offset + step]
            self._offset += step
            yield self.batch_of(block[self.data_rank :: self.data_world])

    def stats(self) -> Dict[str, Any]:
        return {
            "records": self.dataset.records,
            "samples": len(self.dataset),
            "rejected": self.dataset.rejected_count,
            "overlong": self.n_overlong,
            "samples_per_epoch": len(self._usable),
            "batches_per_epoch": len(self),
            "tokens": int(np.minimum(self.dataset.lengths[self._usable], self.max_seq_len).sum()),
        }


def build_preference_loader(
    config: Any,
    tokenizer: Any,
    *,
    split: str = "train",
    data_rank: int = 0,
    data_world: int = 1,
    data_path: Any = None,
    output_dir: Optional[str] = None,
) -> PreferenceLoader:
    """The pair loader of one data rank (``data_path`` overrides the config's train or eval paths)."""
    t = config.train
    train = split == "train"
    sources, _ = data_sources(config, split, data_path)
    encoder = make_encoder(tokenizer, t.template, False)
    ds = load_pairs(
        sources,
        encoder,
        on_bad_record=t.on_bad_record,
        cache_dir=t.data_cache_dir,
        output_dir=output_dir if output_dir is not None else t.output_dir,
    )
    options = BatchOptions.of(config, tokenizer, train=train, data_rank=data_rank, data_world=data_world)
    return PreferenceLoader(ds, options)
