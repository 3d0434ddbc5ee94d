"""Finding data files and reading their records with line numbers; every problem is a (file, line, reason).

JSONL is read line by line in binary so that invalid UTF-8 and invalid JSON are reported on their own
line. A ``.json`` file holding one JSON array (Alpaca's layout) is accepted too; its records are numbered
by the line on which each element starts. Files ending in ``.gz`` or ``.zst`` are decompressed while read
(``.zst`` needs the ``zstandard`` package).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, List, Optional, Sequence, Tuple, Type, Union

from bmtrain_cli.data.columnar import (
    COLUMNAR_SUFFIXES,
    hf_dataset_files,
    is_columnar,
    is_hf_dataset_dir,
    rows,
)
from bmtrain_cli.errors import UserError

DATA_SUFFIXES = (".jsonl", ".json") + COLUMNAR_SUFFIXES
COMPRESSED_SUFFIXES = (".gz", ".zst")


@dataclass
class RawRecord:
    file: str
    line: int  # 1-based
    raw: str  # the record's text (best effort for undecodable bytes)
    value: Any = None  # parsed JSON, None when ``error`` is set
    error: Optional[str] = None

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def as_list(spec: Union[None, str, Sequence[str]]) -> List[str]:
    if spec is None:
        return []
    return [spec] if isinstance(spec, str) else list(spec)


def resolve_source(spec: str) -> List[str]:
    """One data_path entry -> the sorted files it names (file, glob or directory)."""
    p = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(f))
        if not files:
            raise UserError(f"data_path {spec!r}: the pattern matches no file")
        return files
    if p.is_dir() and is_hf_dataset_dir(p):
        return hf_dataset_files(p)
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if _is_data_file(f, p))
        if not files:
            raise UserError(f"data_path {spec!r}: the directory holds no .jsonl or .json file (or .gz/.zst)")
        return files
    if not p.exists():
        raise UserError(f"{spec}: data file not found")
    if not p.is_file():
        raise UserError(f"{spec}: not a regular file")
    return [str(p)]


def _is_data_file(f: Path, root: Path) -> bool:
    """A .jsonl/.json file under root, outside hidden folders and token-cache folders."""
    if not f.is_file() or data_suffix(f.name) not in DATA_SUFFIXES:
        return False
    rel = f.relative_to(root).parts
    if any(part.startswith(".") for part in rel):
        return False
    return not (f.parent / "offsets.npy").exists()


def data_suffix(name: str) -> str:
    """The data suffix of a file name with any compression suffix removed: a.jsonl.gz -> .jsonl."""
    p = Path(name)
    if p.suffix in COMPRESSED_SUFFIXES:
        p = p.with_suffix("")
    return p.suffix


# The longest JSONL line read whole: longer ones become bad records (``on_bad_record``) without being held
# in memory. Readers that know max_seq_len pass ``line_limit(max_seq_len)``; others use the default.
BYTES_PER_TOKEN_BOUND = 256
DEFAULT_MAX_LINE_BYTES = 64 * 2**20
_LINE_BLOCK = 1 << 20


def line_limit(max_seq_len: Optional[int]) -> int:
    """The byte bound of one record's line: 256 x max_seq_len (at least 1 MiB), else the default."""
    if not max_seq_len:
        return DEFAULT_MAX_LINE_BYTES
    return max(_LINE_BLOCK, BYTES_PER_TOKEN_BOUND * int(max_seq_len))


class LongLine(bytes):
    """The start of a line over the limit (the rest was read and dropped); ``size`` is its full length."""

    size: int = 0
    limit: int = 0

    def reason(self) -> str:
        return (
            f"record of {self.size} bytes, over the limit of {self.limit} bytes for one record; not tokenised"
        )


def _compression_error(path: str, exc: BaseException) -> UserError:
    if isinstance(exc, EOFError):
        return UserError(
            f"{path}: truncated: the compressed data ends before its end marker (re-copy the file)"
        )
    return UserError(f"{path}: corrupt compressed data ({type(exc).__name__}: {exc}); re-copy the file")


class DataFile(io.RawIOBase):
    """A data file's bytes (decompressed), where a truncated or corrupt compressed stream is one
    UserError naming the file, and :meth:`readline` never holds more than a limit of one line."""

    def __init__(self, path: str, inner: BinaryIO):
        super().__init__()
        self.path = path
        self._inner = inner
        self._errors: Tuple[Type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile)
        if path.endswith(".zst"):
            import zstandard

            self._errors = (*self._errors, zstandard.ZstdError)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self._errors as exc:
            raise _compression_error(self.path, exc) from None
        except OSError as exc:
            if self.path.endswith(COMPRESSED_SUFFIXES):
                raise _compression_error(self.path, exc) from None
            raise UserError(f"{self.path}: cannot read: {exc.strerror or exc}") from None

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        return self._call(self._inner.read, n)

    def peek(self, n: int = 0) -> bytes:
        return self._call(self._inner.peek, n)  # type: ignore[attr-defined]

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._call(self._inner.seek, offset, whence)

    def tell(self) -> int:
        return self._call(self._inner.tell)

    def readline(self, limit: Optional[int] = None) -> bytes:
        """The next line; over ``limit`` bytes (default: DEFAULT_MAX_LINE_BYTES) a LongLine."""
        cap = DEFAULT_MAX_LINE_BYTES if limit is None or limit < 0 else limit
        line = self._call(self._inner.readline, cap + 1)
        if len(line) <= cap or line.endswith(b"\n"):
            return line
        size = len(line)
        while not line.endswith(b"\n"):  # drop the rest of the line, a block at a time
            line = self._call(self._inner.readline, _LINE_BLOCK)
            if not line:
                break
            size += len(line)
        out = LongLine(b"")
        out.size, out.limit = size, cap
        return out

    def lines(self, limit: Optional[int] = None) -> Iterator[bytes]:
        while True:
            line = self.readline(limit)
            if not line and not isinstance(line, LongLine):
                return
            yield line

    def close(self) -> None:
        self._inner.close()
        super().close()


def open_binary(path: str) -> DataFile:
    """A data file opened for binary reading, decompressed when it ends in .gz or .zst."""
    try:
        if path.endswith(".gz"):
            return DataFile(path, gzip.open(path, "rb"))  # type: ignore[arg-type]
        if path.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise UserError(
                    f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
                ) from None
            raw = open(path, "rb")
            return DataFile(
                path, io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
            )
        return DataFile(path, open(path, "rb"))
    except OSError as exc:
        raise UserError(f"{path}: cannot open: {exc.strerror}") from None


def _decode_error(line: bytes, exc: UnicodeDecodeError) -> str:
    return f"invalid UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1})"


# a \uXXXX escape of a UTF-16 surrogate (D800-DFFF): JSON allows it alone, Unicode text cannot hold it
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _lone_surrogate(value: Any) -> Optional[str]:
    """The first lone UTF-16 surrogate in a record's strings (keys too), as an escape, or None."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"\\u{ord(v[exc.start]):04x}"
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return None


def _parsed(path: str, line: int, raw: str, value: Any) -> RawRecord:
    """A parsed record, made bad when its text holds a lone surrogate (no tokenizer can encode one)."""
    if _SURROGATE_ESCAPE.search(raw):
        bad = _lone_surrogate(value)
        if bad is not None:
            reason = f"invalid text: lone UTF-16 surrogate {bad} (a \\u escape without its pair)"
            return RawRecord(path, line, raw, None, reason)
    return RawRecord(path, line, raw, value)


def _loads(text: str) -> Any:
    """json.loads; nesting deeper than Python's recursion allows is reported as invalid JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", text, 0) from None


def parse_line(path: str, lineno: int, line: bytes) -> RawRecord:
    """One JSONL line (not blank) parsed, or with the reason it is bad."""
    if isinstance(line, LongLine):
        return RawRecord(path, lineno, "", None, line.reason())
    if lineno == 1 and line.startswith(BOM):
        line = line[3:]
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return RawRecord(
            path, lineno, line.decode("utf-8", "replace").rstrip("\n"), None, _decode_error(line, exc)
        )
    text = text.rstrip("\r\n")  # so an error at the end of the line names its real column
    try:
        value = _loads(text)
    except json.JSONDecodeError as exc:
        return RawRecord(path, lineno, text, None, f"invalid JSON: {exc.msg} (column {exc.colno})")
    return _parsed(path, lineno, text, value)


EMPTY_FILE = "file is empty (no records)"
BOM = b"\xef\xbb\xbf"


def is_blank(lineno: int, line: bytes) -> bool:
    """A line that holds no record (only whitespace, or a byte-order mark on line 1)."""
    if isinstance(line, LongLine):
        return False
    return not (line[3:] if lineno == 1 and line.startswith(BOM) else line).strip()


def is_json_array(f: DataFile) -> bool:
    """Whether an open data file holds one JSON array (peeked: the position stays at the start)."""
    head = f.peek(4096)[:4096].lstrip()
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    return head.startswith(b"[")


def _jsonl_lines(f: DataFile, limit: Optional[int] = None) -> Iterator[Tuple[int, Optional[bytes]]]:
    """(line number, line) of every non-blank line of an open JSONL file; (1, None) alone when it has none.
    Lines over ``limit`` bytes come as LongLine."""
    empty = True
    for lineno, line in enumerate(f.lines(limit), start=1):
        if not is_blank(lineno, line):
            empty = False
            yield lineno, line
    if empty:
        yield 1, None


def read_records(path: str, limit: Optional[int] = None) -> Iterator[RawRecord]:
    """Every non-blank record of a JSONL (or JSON-array) file, parsed or with the reason it is bad.

    An empty file (no record at all) yields one bad record at line 1; a line over ``limit`` bytes
    (line_limit) a bad record, without reading it whole.
    """
    if is_columnar(path):
        yield from (
            _parsed(path, n, json.dumps(v, ensure_ascii=False, default=str), v) for n, v in rows(path)
        )
        return
    with open_binary(path) as f:
        if is_json_array(f):
            yield from _read_json_array(path, f.read())
            return
        for lineno, line in _jsonl_lines(f, limit):
            yield (
                parse_line(path, lineno, line)
                if line is not None
                else RawRecord(path, 1, "", None, EMPTY_FILE)
            )


def raw_records(
    path: str, limit: Optional[int] = None
) -> Iterator[Union[RawRecord, Tuple[str, int, Optional[bytes]]]]:
    """The records of a file unparsed, as (file, line, bytes) for a worker to parse (bytes None: the file
    holds no record); a JSON array is parsed here, and its bad records come as RawRecord."""
    if is_columnar(path):
        yield from ((path, n, json.dumps(v, ensure_ascii=False, default=str).encode()) for n, v in rows(path))
        return
    with open_binary(path) as f:
        if is_json_array(f):
            for rec in _read_json_array(path, f.read()):
                yield rec if rec.error is not None else (path, rec.line, rec.raw.encode("utf-8"))
            return
        for lineno, line in _jsonl_lines(f, limit):
            if isinstance(line, LongLine):
                yield RawRecord(path, lineno, "", None, line.reason())
            else:
                yield (path, lineno, line)


def read_values(path: str) -> List[Any]:
    """The parsed records of a JSONL (or JSON-array) file; UserError naming file:line at a bad one."""
    out: List[Any] = []
    for rec in read_records(path):
        if rec.error is not None:
            raise UserError(f"{rec.where()}: {rec.error}")
        out.append(rec.value)
    return out


def _read_json_array(path: str, data: bytes) -> Iterator[RawRecord]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        yield RawRecord(path, line, "", None, f"invalid UTF-8 (byte 0x{data[exc.start]:02x})")
        return
    try:
        items = _loads(text)
    except json.JSONDecodeError as exc:
        yield RawRecord(path, exc.lineno, "", None, f"invalid JSON: {exc.msg} (column {exc.colno})")
        return
    if not items:
        yield RawRecord(path, 1, "", None, "file is empty (the JSON array has no records)")
        return
    # line numbers of the elements: decode element by element from their start offsets
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    line = text.count("\n", 0, pos) + 1
    for _ in items:
        while text[pos] in " \t\r\n,":
            if text[pos] == "\n":
                line += 1
            pos += 1
        value, end = decoder.raw_decode(text, pos)
        raw = text[pos:end]
        yield _parsed(path, line, raw, value)
        line += raw.count("\n")
        pos = end
