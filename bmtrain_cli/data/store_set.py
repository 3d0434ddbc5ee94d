"""What the cached SFT loader (data/loader.py) and the preference loader (preference/loader.py) share: a
set of token stores read as one dataset, the batch options a config gives a loader, and the loader base
that holds them with the position ``(epoch, offset)`` that resumes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, Generic, List, Optional, Tuple, TypeVar, Union

from bmtrain_cli.data.cache import TokenStore
from bmtrain_cli.data.rejected_log import save_rejected
from bmtrain_cli.errors import UserError


@dataclass
class StoreSet:
    """The token stores of every source file, in order."""

    stores: List[TokenStore]

    @property
    def fingerprint(self) -> str:
        """Names the cache directories (each a hash of file, tokenizer, template, format): a resumed run
        continues the data order only over the same data."""
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

    def refuse_bad_records(self, on_bad_record: str) -> None:
        """With on_bad_record "error", the first bad record as a one-line UserError ``file:line: reason``."""
        bad = self.rejected_count
        if bad and on_bad_record == "error":
            first = self.rejected()[0]
            more = (
                f" ({bad - 1} more bad record{'s' if bad > 2 else ''}; on_bad_record: skip sets them aside)"
            )
            raise UserError(f"{first['file']}:{first['line']}: {first['reason']}{more if bad > 1 else ''}")


BATCHING_MODES = ("max_length", "longest", "packed")


@dataclass(frozen=True)
class BatchOptions:
    """How a loader of one data rank cuts micro-batches (``of``: from a config and its tokenizer)."""

    max_seq_len: int
    micro_batch_size: int
    pad_id: int
    bos_id: Optional[int] = None
    batching: str = "longest"
    truncation: str = "left"
    shuffle: bool = True
    seed: int = 0
    data_rank: int = 0
    data_world: int = 1
    infinite: bool = True  # a training loader runs epoch after epoch; an eval loader makes one pass

    @classmethod
    def of(
        cls,
        config: Any,
        tokenizer: Any,
        *,
        train: bool = True,
        seed: Optional[int] = None,
        micro_batch_size: Optional[int] = None,
        data_rank: int = 0,
        data_world: int = 1,
    ) -> BatchOptions:
        t = config.train
        return cls(
            max_seq_len=int(config.model.max_seq_len),
            micro_batch_size=int(micro_batch_size or t.micro_batch_size),
            pad_id=int(tokenizer.pad_id),
            bos_id=tokenizer.bos_id,
            batching=t.batching,
            truncation=t.truncation,
            shuffle=bool(t.shuffle and train),
            seed=int(t.seed if seed is None else seed),
            data_rank=data_rank,
            data_world=data_world,
            infinite=train,
        )


DatasetT = TypeVar("DatasetT", bound=StoreSet)


class StoreLoader(Generic[DatasetT]):
    """The base of a loader over a StoreSet whose order is a function of the seed and the epoch: its batch
    options as attributes, its position ``(epoch, offset)``, ``state_dict`` / ``load_state_dict`` and the
    rejected-records log. ORDER_KEYS are the settings the order depends on besides the data: a checkpoint
    written with others cannot be resumed exactly."""

    ORDER_KEYS: ClassVar[Tuple[str, ...]] = ("seed", "batching")
    DATA_NAME: ClassVar[str] = "training data"

    def __init__(self, dataset: DatasetT, options: BatchOptions) -> None:
        o = options
        if o.batching not in BATCHING_MODES:
            raise UserError(f"unknown batching {o.batching!r}; choose one of {', '.join(BATCHING_MODES)}")
        if not 0 <= o.data_rank < o.data_world:
            raise ValueError(f"data_rank {o.data_rank} out of range for data_world {o.data_world}")
        self.dataset = dataset
        self.options = o
        self.max_seq_len, self.micro_batch_size = o.max_seq_len, o.micro_batch_size
        self.pad_id, self.bos_id = o.pad_id, o.bos_id
        self.batching, self.truncation = o.batching, o.truncation
        self.shuffle, self.seed = o.shuffle, o.seed
        self.data_rank, self.data_world = o.data_rank, o.data_world
        self.infinite = o.infinite
        self.epoch, self._offset = 0, 0

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
        for key in self.ORDER_KEYS:
            if key in state and state[key] != getattr(self, key):
                raise UserError(
                    f"cannot resume the data order: the checkpoint used {key}={state[key]!r}, "
                    f"this run {getattr(self, key)!r}"
                )
        fp = state.get("data_fingerprint")
        if fp is not None and fp != self.dataset.fingerprint:
            raise UserError(
                f"cannot resume the data order exactly: the {self.DATA_NAME}, tokenizer or template changed "
                "since the checkpoint was written"
            )
        self.epoch = int(state["epoch"])
        self._offset = int(state["offset"])

    def start_rejected_log(self, output_dir: Union[str, Path], is_main: bool = True) -> None:
        """Write the rejected records to output_dir/rejected.jsonl (the main rank; all are known now)."""
        if is_main and self.dataset.rejected_count:
            save_rejected(self.dataset.rejected(), self.dataset.rejected_count, output_dir)
