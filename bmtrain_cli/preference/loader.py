"""The preference data loader: pair stores -> seeded epoch order over pairs -> data-parallel shard ->
micro-batches of ``micro_batch_size`` pairs (2 x micro_batch_size sequences).

Order, sharding and resume follow the SFT loader (data/loader.py): the epoch order is a seeded permutation
of the usable pairs, each step takes a block of micro_batch_size x data_world pairs, rank r takes the block's
pairs r, r + world, ..., and the position is ``(epoch, offset)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from bmtrain_cli.data.cache import TokenStore
from bmtrain_cli.data.encode import make_encoder
from bmtrain_cli.data.readers import as_list, resolve_source
from bmtrain_cli.data.rejected_log import save_rejected
from bmtrain_cli.errors import UserError
from bmtrain_cli.preference.batches import Sample, collate_pairs, truncate_pair
from bmtrain_cli.preference.pairs import open_or_build_pairs


@dataclass
class PairDataset:
    """The pairs of every source file; global pair id = position in the concatenation."""

    stores: List[TokenStore]

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

    @property
    def fingerprint(self) -> str:
        names = [s.directory.name for s in self.stores]
        return hashlib.sha256(json.dumps(names).encode()).hexdigest()[:16]

    @property
    def records(self) -> int:
        return sum(s.records for s in self.stores)

    @property
    def rejected_count(self) -> int:
        return sum(s.rejected_count for s in self.stores)

    def rejected(self) -> List[dict]:
        return [r for s in self.stores for r in s.rejected]


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
    bad = ds.rejected_count
    if bad and on_bad_record == "error":
        first = ds.rejected()[0]
        more = f" ({bad - 1} more bad record{'s' if bad > 2 else ''}; on_bad_record: skip sets them aside)"
        raise UserError(f"{first['file']}:{first['line']}: {first['reason']}{more if bad > 1 else ''}")
    if len(ds) == 0:
        raise UserError(
            f"no usable preference pair in {', '.join(files)}" + (f" ({bad} rejected)" if bad else "")
        )
    return ds


class PreferenceLoader:
    """Micro-batches of pairs for one data rank; resumable like the SFT loader."""

    def __init__(
        self,
        dataset: PairDataset,
        *,
        max_seq_len: int,
        micro_batch_size: int,
        pad_id: int,
        bos_id: Optional[int] = None,
        batching: str = "longest",
        truncation: str = "left",
        shuffle: bool = True,
        seed: int = 0,
        data_rank: int = 0,
        data_world: int = 1,
        infinite: bool = True,
    ):
        self.dataset = dataset
        self.max_seq_len = int(max_seq_len)
        self.micro_batch_size = int(micro_batch_size)
        self.pad_id, self.bos_id = int(pad_id), bos_id
        self.batching, self.truncation = batching, truncation
        self.shuffle, self.seed = shuffle, int(seed)
        self.data_rank, self.data_world = data_rank, data_world
        self.infinite = infinite
        self.epoch, self._offset = 0, 0
        longest = dataset.lengths.max(axis=1) if len(dataset) else np.zeros(0, np.int64)
        over = longest > self.max_seq_len
        self.n_overlong = int(over.sum())
        self._usable = np.nonzero(~over if truncation == "drop" else np.ones(len(dataset), bool))[0]
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

    def state_dict(self) -> Dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self._offset,
            "seed": self.seed,
            "batching": self.batching,
            "data_fingerprint": self.dataset.fingerprint,
            "micro_batch_size": self.micro_batch_size,
            "data_world": self.data_world,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise UserError(f"cannot resume the data order: the checkpoint used seed={state['seed']!r}")
        if state.get("data_fingerprint", self.dataset.fingerprint) != self.dataset.fingerprint:
            raise UserError(
                "cannot resume the data order exactly: the preference data, tokenizer or template changed "
                "since the checkpoint was written"
            )
        self.epoch, self._offset = int(state["epoch"]), int(state["offset"])

    def start_rejected_log(self, output_dir: Any, is_main: bool = True) -> None:
        """Write the rejected pairs to output_dir/rejected.jsonl (the main rank; all are known now)."""
        if is_main and self.dataset.rejected_count:
            save_rejected(self.dataset.rejected(), self.dataset.rejected_count, output_dir)

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
    spec = data_path if data_path is not None else (t.data_path if train else t.eval_data_path)
    sources = as_list(spec)
    if not sources:
        raise UserError(f"no {split} data: set train_config.{'data_path' if train else 'eval_data_path'}")
    encoder = make_encoder(tokenizer, t.template, False)
    ds = load_pairs(
        sources,
        encoder,
        on_bad_record=t.on_bad_record,
        cache_dir=t.data_cache_dir,
        output_dir=output_dir if output_dir is not None else t.output_dir,
    )
    return PreferenceLoader(
        ds,
        max_seq_len=config.model.max_seq_len,
        micro_batch_size=t.micro_batch_size,
        pad_id=tokenizer.pad_id,
        bos_id=tokenizer.bos_id,
        batching=t.batching,
        truncation=t.truncation,
        shuffle=t.shuffle and train,
        seed=t.seed,
        data_rank=data_rank,
        data_world=data_world,
        infinite=train,
    )
