"""The token cache: each source file tokenised once into memory-mapped arrays, reused while unchanged.

One directory per (file contents, tokenizer, template, format, train_on_prompt), named by a hash of all of
them, holding ``tokens.bin`` (int32), ``mask.bin`` (uint8, 1 = trained), ``offsets.npy`` (int64, n+1),
``lines.npy`` (source line of each sample) and ``meta.json`` (written last: its presence means complete;
it also lists the rejected records with their reasons). Building takes a file lock, so several ranks
starting together tokenise once and the others wait and reuse the result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple

import numpy as np

from bmtrain_cli.data.encode import Encoder
from bmtrain_cli.data.readers import RawRecord, raw_records
from bmtrain_cli.data.turns import DEFAULT
from bmtrain_cli.data.workers import EncodeSpec, Item, OrderedPool
from bmtrain_cli.errors import user_write_error

CACHE_VERSION = 2  # 2: a tokenizer chat template's text is tokenised as one string between specials
CACHE_DIRNAME = ".bmtrain_cache"
MAX_REJECTED_KEPT = 100_000
ENCODE_CHUNK = 1024  # records per worker task (one batched tokenizer call)


def file_hash(path: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def template_id(template: object) -> str:
    source = getattr(template, "source", None)
    text = source if source is not None else repr(template)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def cache_key(path: str, encoder: Encoder, data_format: str) -> str:
    parts = [
        f"v{CACHE_VERSION}",
        file_hash(path),
        encoder.tokenizer.fingerprint(),
        template_id(encoder.template),
        data_format,
        str(bool(encoder.train_on_prompt)),
    ]
    if encoder.options != DEFAULT:
        parts.append(encoder.options.key())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


@dataclass
class TokenStore:
    """The tokenised samples of one source file (memory-mapped)."""

    file: str
    directory: Path
    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray
    records: int  # records read (good + rejected)
    rejected: List[dict] = field(default_factory=list)
    rejected_count: int = 0
    built: bool = False  # True when this call tokenised the file (False: reused the cache)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.mask[a:b]


def load_store(directory: Path, path: str, built: bool) -> TokenStore:
    """The TokenStore a complete cache directory holds (memory-mapped)."""
    meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
    offsets = np.load(directory / "offsets.npy")
    n_tok = int(offsets[-1])
    tokens: np.ndarray
    mask: np.ndarray
    if n_tok:
        tokens = np.memmap(directory / "tokens.bin", dtype=np.int32, mode="r", shape=(n_tok,))
        mask = np.memmap(directory / "mask.bin", dtype=np.uint8, mode="r", shape=(n_tok,))
    else:
        tokens, mask = np.zeros(0, np.int32), np.zeros(0, np.uint8)
    return TokenStore(
        file=path,
        directory=directory,
        tokens=tokens,
        mask=mask,
        offsets=offsets,
        lines=np.load(directory / "lines.npy"),
        records=int(meta["records"]),
        rejected=list(meta["rejected"]),
        rejected_count=int(meta["rejected_count"]),
        built=built,
    )


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive cross-process lock on ``path`` (POSIX; none elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no cross-process lock
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def default_cache_root(path: str, output_dir: Optional[str]) -> Path:
    """Beside the data when writable, else under output_dir."""
    beside = Path(path).resolve().parent / CACHE_DIRNAME
    try:
        beside.mkdir(parents=True, exist_ok=True)
        probe = beside / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return beside
    except OSError:
        return Path(output_dir or ".") / "data_cache"


class Rejections:
    """The bad records of one file: every one counted, the first MAX_REJECTED_KEPT kept with the reason."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.kept: List[dict] = []
        self.count = 0

    def add(self, line: int, reason: str, raw: str) -> None:
        self.count += 1
        if len(self.kept) < MAX_REJECTED_KEPT:
            self.kept.append({"file": self.path, "line": line, "reason": reason, "record": raw})


def finish_store(
    sink_dir: Path,
    offsets: List[int],
    lines: List[int],
    records: int,
    rejections: Rejections,
    **extra: object,
) -> None:
    """Write offsets.npy, lines.npy and, last and atomically, meta.json (its presence means complete);
    ``extra`` adds keys to meta.json. tokens.bin and mask.bin are already written."""
    np.save(sink_dir / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(sink_dir / "lines.npy", np.asarray(lines, dtype=np.int64))
    meta: Dict[str, object] = {
        "version": CACHE_VERSION,
        **extra,
        "file": str(Path(rejections.path).resolve()),
        "records": records,
        "samples": len(lines),
        "tokens": offsets[-1],
        "rejected_count": rejections.count,
        "rejected": sorted(rejections.kept, key=lambda r: r["line"]),
        "created": time.time(),
    }
    tmp = sink_dir / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
    tmp.replace(sink_dir / "meta.json")


def cached_store(path: str, root: Path, name: str, build: Callable[[Path], None]) -> TokenStore:
    """The store ``root/name`` of ``path``: reused when complete, else built now by ``build(directory)``
    under a file lock (several ranks starting together build it once; the others wait and reuse it)."""
    directory = root / name
    if (directory / "meta.json").is_file():
        return load_store(directory, path, built=False)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with file_lock(root / f"{name}.lock"):
            if (directory / "meta.json").is_file():  # another process built it while we waited
                return load_store(directory, path, built=False)
            directory.mkdir(parents=True, exist_ok=True)
            build(directory)
    except OSError as exc:  # a full disk (numpy says "N requested and M written"), a read-only root
        error = user_write_error(exc, directory)
        if error is None:
            raise
        if not (directory / "meta.json").is_file():  # never complete: nothing is lost
            shutil.rmtree(directory, ignore_errors=True)
        raise error from None
    return load_store(directory, path, built=True)


def tokenize_file(
    path: str,
    encoder: Encoder,
    data_format: str,
    sink_dir: Path,
    progress: Optional[Callable[[int], None]] = None,
    workers: int = 0,
) -> None:
    """Tokenise every record of ``path`` into sink_dir (meta.json last), in ``workers`` processes."""
    rejections = Rejections(path)
    offsets = [0]
    lines: List[int] = []
    n_records = 0
    tasks: Deque[List[Item]] = deque()

    def task_list() -> Iterator[List[Item]]:
        nonlocal n_records
        buf: List[Item] = []
        for x in raw_records(path):
            n_records += 1
            if isinstance(x, RawRecord):
                rejections.add(x.line, x.error or "", x.raw)
                continue
            buf.append(x)
            if len(buf) == ENCODE_CHUNK:
                tasks.append(buf)
                yield buf
                buf = []
        if buf:
            tasks.append(buf)
            yield buf

    spec = EncodeSpec.of(encoder, data_format)
    tok_path, mask_path = sink_dir / "tokens.bin", sink_dir / "mask.bin"
    pool = OrderedPool(spec, workers, encoder=encoder)
    try:
        with open(tok_path, "wb") as ftok, open(mask_path, "wb") as fmask:
            for enc in pool.map(task_list()):
                items = tasks.popleft()
                for i, reason, raw in enc.bad:
                    rejections.add(items[i][1], reason, raw)
                ftok.write(enc.tokens.tobytes())
                fmask.write(enc.mask.tobytes())
                offsets.extend((offsets[-1] + enc.offsets[1:]).tolist())
                lines.extend(items[int(i)][1] for i in enc.index)
                if progress is not None:
                    progress(len(lines))
    finally:
        pool.close()
    finish_store(sink_dir, offsets, lines, n_records, rejections)


def open_or_build(
    path: str,
    encoder: Encoder,
    data_format: str = "auto",
    cache_root: Optional[str] = None,
    output_dir: Optional[str] = None,
    progress: Optional[Callable[[int], None]] = None,
    workers: int = 0,
) -> TokenStore:
    """The TokenStore of ``path``: from the cache when its key matches, else tokenised now and cached."""
    root = Path(cache_root) if cache_root else default_cache_root(path, output_dir)
    name = f"{Path(path).stem}-{cache_key(path, encoder, data_format)}"
    return cached_store(
        path,
        root,
        name,
        lambda directory: tokenize_file(path, encoder, data_format, directory, progress, workers),
    )
