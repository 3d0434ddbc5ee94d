"""The training data loader: token cache -> seeded epoch order -> data-parallel shard -> micro-batches.

Order and resume: every epoch's order is a seeded permutation over the cached samples (a function of
seed and epoch only), optionally packed into rows; the loader's position is ``(epoch, offset)`` where offset
counts the rows ("units") of the epoch already handed out to all data ranks together. Resuming is setting
that number, and the next batch is the one an uninterrupted run would have seen.

Sharding: each step consumes a block of ``micro_batch_size x data_world`` units; rank r takes the block's
units r, r + world, ... So each sample is seen once per epoch across ranks, and ranks stay in step: a rank
whose share of the last block is empty gets a batch with no target (zero loss, zero token count).

Tokenisation is off the training step: it happens once, before training, into the cache (cache.py);
batches are then cut from memory-mapped arrays, optionally in a background thread (num_workers >= 1).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Generator, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from bmtrain_cli.data.background import in_background
from bmtrain_cli.data.cache import open_or_build
from bmtrain_cli.data.collate import TRUNC_ANSWER, collate, empty_batch, pack, truncate
from bmtrain_cli.data.encode import Encoder, make_encoder
from bmtrain_cli.data.readers import as_list, resolve_source
from bmtrain_cli.data.rejected_log import save_rejected
from bmtrain_cli.data.store_set import BatchOptions, StoreLoader, StoreSet
from bmtrain_cli.data.stream_setup import build_stream_loader, choose_streaming, data_workers
from bmtrain_cli.data.turns import options_of
from bmtrain_cli.errors import UserError

if TYPE_CHECKING:
    from bmtrain_cli.data.stream import StreamLoader

log = logging.getLogger("bmtrain.data")


@dataclass
class Dataset(StoreSet):
    """All tokenised samples of the sources; global sample id = position in the concatenation."""

    store_source: List[int]  # index of the data_path entry each store came from
    n_sources: int
    starts: np.ndarray = field(init=False)
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        sizes = [len(s) for s in self.stores]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = (
            np.concatenate([s.lengths for s in self.stores]).astype(np.int64)
            if self.stores
            else np.zeros(0, np.int64)
        )

    def __len__(self) -> int:
        return int(self.starts[-1])

    def sample(self, gid: int) -> Tuple[np.ndarray, np.ndarray]:
        k = int(np.searchsorted(self.starts, gid, side="right")) - 1
        ids, mask = self.stores[k].sample(gid - int(self.starts[k]))
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)

    def source_ids(self) -> List[np.ndarray]:
        out: List[List[np.ndarray]] = [[] for _ in range(self.n_sources)]
        for k in range(len(self.stores)):
            out[self.store_source[k]].append(np.arange(self.starts[k], self.starts[k + 1], dtype=np.int64))
        return [np.concatenate(x) if x else np.zeros(0, np.int64) for x in out]

    def where(self, gid: int) -> str:
        k = int(np.searchsorted(self.starts, gid, side="right")) - 1
        return f"{self.stores[k].file}:{int(self.stores[k].lines[gid - int(self.starts[k])])}"


def load_dataset(
    sources: Sequence[str],
    encoder: Encoder,
    *,
    data_format: str = "auto",
    on_bad_record: str = "error",
    cache_dir: Optional[str] = None,
    output_dir: Optional[str] = None,
    write_rejected: bool = True,
    workers: int = 0,
) -> Dataset:
    """Resolve, validate and tokenise (or reuse the cache of) every source file.

    on_bad_record "error": the first bad record raises a one-line UserError ``file:line: reason``.
    "skip": bad records are counted and written with their reason to output_dir/rejected.jsonl.
    """
    files: List[Tuple[str, int]] = []
    for i, spec in enumerate(sources):
        files.extend((f, i) for f in resolve_source(spec))
    stores = [
        open_or_build(f, encoder, data_format, cache_root=cache_dir, output_dir=output_dir, workers=workers)
        for f, _ in files
    ]
    ds = Dataset(stores, [i for _, i in files], len(sources))
    ds.refuse_bad_records(on_bad_record)
    bad = ds.rejected_count
    if bad and write_rejected and output_dir:
        save_rejected(ds.rejected(), ds.rejected_count, output_dir)
    if len(ds) == 0:
        where = ", ".join(f for f, _ in files)
        raise UserError(f"no usable record in {where}" + (f" ({bad} rejected)" if bad else ""))
    return ds


class Loader(StoreLoader[Dataset]):
    """Iterate micro-batches for one data rank; ``state_dict()`` / ``load_state_dict()`` resume exactly.

    Iterating a training loader never ends (epochs follow each other; ``epoch`` says which one is
    running); an eval loader (``infinite=False``) makes one pass. ``len(loader)`` is the number of
    micro-batches per epoch, the same on every rank.
    """

    def __init__(
        self,
        dataset: Dataset,
        options: BatchOptions,
        *,
        weights: Optional[Sequence[float]] = None,
        num_workers: int = 0,
        pack_window: int = 16,
    ):
        super().__init__(dataset, options)
        self.weights = list(weights) if weights else None
        self.num_workers = num_workers
        self.pack_window = pack_window
        self._plan: Optional[Tuple[int, List[Any]]] = None

        over = dataset.lengths > self.max_seq_len
        self.n_overlong = int(over.sum())
        if self.truncation == "drop":
            self._usable = ~over
            self._lengths = dataset.lengths
        else:
            self._usable = np.ones(len(dataset), dtype=bool)
            self._lengths = np.minimum(dataset.lengths, self.max_seq_len)
        if not self._usable.any():
            raise UserError(
                f"every sample is longer than max_seq_len {self.max_seq_len} and truncation is 'drop'"
            )
        self._sources = [ids[self._usable[ids]] for ids in dataset.source_ids()]
        if self.weights is not None and len(self.weights) != len(self._sources):
            raise UserError(f"{len(self.weights)} data_weights for {len(self._sources)} data sources")
        self._answer_truncated: Optional[int] = None

    # ---- epoch plan
    def _epoch_samples(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        parts = []
        total = sum(len(s) for s in self._sources)
        wsum = sum(self.weights) if self.weights else 0.0
        for i, ids in enumerate(self._sources):
            if self.weights is None or len(ids) == 0:
                parts.append(ids)
                continue
            n = int(round(total * self.weights[i] / wsum))
            src_rng = np.random.default_rng([self.seed, epoch, i + 1])
            reps = -(-n // len(ids))
            pool = np.concatenate([src_rng.permutation(ids) if self.shuffle else ids for _ in range(reps)])
            parts.append(pool[:n])
        order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return rng.permutation(order) if self.shuffle else order

    def _units(self, epoch: int) -> List[Any]:
        if self._plan is None or self._plan[0] != epoch:
            order = self._epoch_samples(epoch)
            if self.batching == "packed":
                units: List[Any] = pack(order, self._lengths, self.max_seq_len, self.pack_window)
            else:
                units = [[int(s)] for s in order]
            self._plan = (epoch, units)
        return self._plan[1]

    def __len__(self) -> int:
        per_step = self.micro_batch_size * self.data_world
        return -(-len(self._units(self.epoch)) // per_step)

    @property
    def longest(self) -> int:
        """Tokens of the longest sample a batch can hold (after truncation; dropped samples excluded)."""
        return int(min(self._lengths[self._usable].max(), self.max_seq_len))

    @property
    def samples_per_epoch(self) -> int:
        return len(self._epoch_samples(self.epoch))

    # ---- batches
    def _sample(self, gid: int) -> Tuple[np.ndarray, np.ndarray]:
        ids, mask = self.dataset.sample(gid)
        if len(ids) > self.max_seq_len:
            (ids, mask), _ = truncate(ids, mask, self.max_seq_len, self.bos_id)
        return ids, mask

    def _batch_at(self, epoch: int, offset: int) -> Dict[str, np.ndarray]:
        units = self._units(epoch)
        block = units[offset : offset + self.micro_batch_size * self.data_world]
        mine = block[self.data_rank :: self.data_world]
        if not mine:
            return empty_batch(self.pad_id)
        rows = [[self._sample(g) for g in unit] for unit in mine]
        width = None if self.batching == "longest" else self.max_seq_len
        return collate(rows, self.pad_id, width)

    def _positions(self) -> Iterator[Tuple[int, int, int, int]]:
        """(epoch, offset) of each next batch and the position after it, from the current state."""
        epoch, offset = self.epoch, self._offset
        step = self.micro_batch_size * self.data_world
        while True:
            n_units = len(self._units(epoch))
            if offset >= n_units:
                if not self.infinite:
                    return
                epoch, offset = epoch + 1, 0
                continue
            nxt_epoch, nxt = epoch, offset + step
            yield epoch, offset, nxt_epoch, nxt
            epoch, offset = nxt_epoch, nxt

    def _produce(self) -> Generator[Tuple[Dict[str, np.ndarray], int, int], None, None]:
        for epoch, offset, e2, o2 in self._positions():
            yield self._batch_at(epoch, offset), e2, o2

    def __iter__(self) -> Iterator[Dict[str, np.ndarray]]:
        if not self.infinite:
            self._offset = 0  # an eval pass always covers the whole split
        source = (
            self._produce()
            if self.num_workers <= 0
            else in_background(
                self._produce, ahead=max(2, 2 * self.num_workers), name="bmtrain-data-prefetch"
            )
        )
        for batch, epoch, offset in source:
            self.epoch, self._offset = epoch, offset
            yield batch

    # ---- reporting
    def stats(self) -> Dict[str, Any]:
        if self._answer_truncated is None:
            n = 0
            for gid in np.nonzero(self.dataset.lengths > self.max_seq_len)[0]:
                ids, mask = self.dataset.sample(int(gid))
                if truncate(ids, mask, self.max_seq_len, self.bos_id)[1] == TRUNC_ANSWER:
                    n += 1
            self._answer_truncated = n
        return {
            "records": self.dataset.records,
            "samples": len(self.dataset),
            "rejected": self.dataset.rejected_count,
            "overlong": self.n_overlong,
            "truncated": self.n_overlong if self.truncation == "left" else 0,
            "truncated_answer": self._answer_truncated if self.truncation == "left" else 0,
            "dropped": self.n_overlong if self.truncation == "drop" else 0,
            "samples_per_epoch": self.samples_per_epoch,
            "batches_per_epoch": len(self),
            "tokens": int(self._lengths[self._usable].sum()),
        }


def data_sources(config: Any, split: str, data_path: Any = None) -> Tuple[List[str], Optional[List[float]]]:
    """(source specs, data_weights or None) of a split (train, or eval/heldout/validation); ``data_path``
    overrides the config's paths."""
    t = config.train
    if split == "train":
        sources = as_list(data_path if data_path is not None else t.data_path)
        weights = list(t.data_weights) if (t.data_weights and data_path is None) else None
    elif split in ("eval", "heldout", "validation"):
        sources = as_list(data_path if data_path is not None else t.eval_data_path)
        weights = None
    else:
        raise ValueError(f"unknown split {split!r}")
    if not sources:
        raise UserError(
            f"no {split} data: set train_config.{'data_path' if split == 'train' else 'eval_data_path'}"
        )
    return sources, weights


def build_loader(
    config: Any,
    tokenizer: Any,
    *,
    split: str = "train",
    data_rank: int = 0,
    data_world: int = 1,
    seed: Optional[int] = None,
    data_path: Any = None,
    micro_batch_size: Optional[int] = None,
    output_dir: Optional[str] = None,
    write_rejected: bool = True,
    streaming: Optional[bool] = None,
) -> Union[Loader, StreamLoader]:
    """The loader of one data rank for a config (``data_path`` overrides the config's paths).

    Every record is validated (and tokenised into the cache, or read from it) here, before training,
    unless the training split streams (stream_setup.py): then a StreamLoader reads as it trains.
    ``streaming`` True/False overrides train_config.streaming (False: always the token cache).
    A training loader writes its rejected records to output_dir/rejected.jsonl unless ``write_rejected``
    is False (the trainer has the loader write it, ``start_rejected_log``, once every check has passed).
    """
    t = config.train
    sources, weights = data_sources(config, split, data_path)
    train = split == "train"
    seed = t.seed if seed is None else seed
    micro = micro_batch_size or t.micro_batch_size
    if train and streaming is not False:
        groups = [resolve_source(spec) for spec in sources]
        stream, notice = choose_streaming(t, [f for g in groups for f in g], streaming)
        if stream:
            return build_stream_loader(
                config,
                tokenizer,
                groups,
                weights,
                data_rank=data_rank,
                data_world=data_world,
                seed=seed,
                micro_batch_size=micro,
                notice=notice,
            )
        if notice:
            log.warning(notice)
    encoder = make_encoder(tokenizer, t.template, t.train_on_prompt, options_of(t))
    out_dir = output_dir if output_dir is not None else t.output_dir
    ds = load_dataset(
        sources,
        encoder,
        data_format=t.data_format,
        on_bad_record=t.on_bad_record,
        cache_dir=t.data_cache_dir,
        output_dir=out_dir,
        write_rejected=write_rejected and train,
        workers=data_workers(t),
    )
    return loader_for(
        config,
        tokenizer,
        ds,
        train=train,
        seed=seed,
        micro_batch_size=micro,
        weights=weights,
        data_rank=data_rank,
        data_world=data_world,
    )


def loader_for(
    config: Any,
    tokenizer: Any,
    ds: Dataset,
    *,
    train: bool = True,
    seed: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    weights: Optional[Sequence[float]] = None,
    data_rank: int = 0,
    data_world: int = 1,
) -> Loader:
    """The cached-mode Loader of a config over a dataset already built."""
    options = BatchOptions.of(
        config,
        tokenizer,
        train=train,
        seed=seed,
        micro_batch_size=micro_batch_size,
        data_rank=data_rank,
        data_world=data_world,
    )
    return Loader(ds, options, weights=weights, num_workers=config.train.num_workers)
