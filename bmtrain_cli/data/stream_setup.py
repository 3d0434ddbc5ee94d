"""Choosing streaming mode for a config and building its loader.

``streaming: true`` streams; ``auto`` (the default) streams when the training files add up to
``STREAM_AUTO_BYTES`` or more on disk and the run can stream (max_steps set), saying so in one line;
``false`` always tokenises into the token cache first (cache.py).
"""

from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

from bmtrain_cli.data.workers import EncodeSpec, default_workers

STREAM_AUTO_BYTES = 1 << 30  # 1 GiB of data files on disk


def _size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def choose_streaming(train: Any, files: Sequence[str], override: Optional[bool] = None) -> Tuple[bool, str]:
    """(stream?, the one line that says why when it was chosen automatically or could not be)."""
    mode = train.streaming if override is None else override
    if mode is True:
        return True, ""
    if mode is False:
        return False, ""
    size = sum(os.path.getsize(f) for f in files)
    if size < STREAM_AUTO_BYTES:
        return False, ""
    if train.max_steps is None:
        return False, (
            f"note: the training data is {_size_text(size)}; set max_steps to stream it instead of "
            "tokenising it all into the cache first (streaming: auto)"
        )
    return True, (
        f"streaming {_size_text(size)} of training data ({len(files)} files; streaming: auto from "
        f"{_size_text(STREAM_AUTO_BYTES)}; streaming: false tokenises it into the cache first)"
    )


def data_workers(train: Any) -> int:
    """``data_workers`` or its default, the CPUs shared by the ranks of this machine."""
    if train.data_workers is not None:
        return int(train.data_workers)
    local = int(os.environ.get("PADDLE_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")) or 1)
    return default_workers((os.cpu_count() or 1) // max(1, local))


def collectives(
    data_world: int,
) -> Tuple[Optional[Callable[[int], int]], Optional[Callable[[Any], List[Any]]]]:
    """(agree, gather) over every rank of an initialised paddle.distributed run; (None, None) otherwise."""
    if data_world <= 1:
        return None, None
    try:
        import paddle
        import paddle.distributed as dist
    except ImportError:  # pragma: no cover - several data ranks imply Paddle
        return None, None
    if not dist.is_initialized():
        return None, None

    def agree(flag: int) -> int:
        t = paddle.to_tensor([int(flag)], dtype="int64")
        dist.all_reduce(t)
        return int(t.numpy()[0])

    def gather(obj: Any) -> List[Any]:
        out: List[Any] = []
        dist.all_gather_object(out, obj)
        return out

    return agree, gather


def build_stream_loader(
    config: Any,
    tokenizer: Any,
    groups: Sequence[Sequence[str]],
    weights: Optional[Sequence[float]],
    *,
    data_rank: int,
    data_world: int,
    seed: int,
    micro_batch_size: int,
    notice: str,
) -> Any:
    from bmtrain_cli.data.columnar import is_columnar
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.stream import StreamLoader
    from bmtrain_cli.data.turns import options_of
    from bmtrain_cli.errors import UserError

    t = config.train
    spec = EncodeSpec.of(
        make_encoder(tokenizer, t.template, t.train_on_prompt, options_of(t)),
        t.data_format,
        max_seq_len=config.model.max_seq_len,
        truncation=t.truncation,
    )
    tabular = [f for g in groups for f in g if is_columnar(f)]
    if tabular:
        raise UserError(
            f"{tabular[0]}: streaming reads JSONL files; tabular files (CSV, Parquet, Arrow) go through the "
            "token cache: set train_config.streaming: false"
        )
    agree, gather = collectives(data_world)
    workers = data_workers(t)
    files = sum(len(g) for g in groups)
    line = notice or f"streaming the training data ({files} file{'s' if files != 1 else ''})"
    line += f"; {workers} tokenizer worker{'s' if workers != 1 else ''}, shuffle buffer {t.shuffle_buffer}"
    return StreamLoader(
        groups,
        spec,
        micro_batch_size=micro_batch_size,
        pad_id=tokenizer.pad_id,
        batching=t.batching,
        shuffle=t.shuffle,
        seed=seed,
        shuffle_buffer=t.shuffle_buffer,
        weights=weights,
        data_rank=data_rank,
        data_world=data_world,
        workers=workers,
        on_bad_record=t.on_bad_record,
        step_batches=config.derived().grad_accum_steps,
        agree=agree,
        gather=gather,
        notice=line,
    )
