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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, List, Optional, Sequence, Tuple, Union

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


def open_binary(path: str) -> BinaryIO:
    """A data file opened for binary reading, decompressed when it ends in .gz or .zst."""
    try:
        if path.endswith(".gz"):
            return gzip.open(path, "rb")  # type: ignore[return-value]
        if path.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise UserError(
                    f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
                ) from None
            raw = open(path, "rb")
            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
        return open(path, "rb")
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
    return not (line[3:] if lineno == 1 and line.startswith(BOM) else line).strip()


def is_json_array(f: BinaryIO) -> bool:
    """Whether an open data file holds one JSON array (peeked: the position stays at the start)."""
    head = f.peek(4096)[:4096].lstrip()  # type: ignore[attr-defined]
    if head.startswith(b"\xef\xbb\xbf"):
        head = head[3:].lstrip()
    return head.startswith(b"[")


def _jsonl_lines(f: BinaryIO) -> Iterator[Tuple[int, Optional[bytes]]]:
    """(line number, line) of every non-blank line of an open JSONL file; (1, None) alone when it has none."""
    empty = True
    for lineno, line in enumerate(f, start=1):
        if not is_blank(lineno, line):
            empty = False
            yield lineno, line
    if empty:
        yield 1, None


def read_records(path: str) -> Iterator[RawRecord]:
    """Every non-blank record of a JSONL (or JSON-array) file, parsed or with the reason it is bad.

    An empty file (no record at all) yields one bad record at line 1.
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
        for lineno, line in _jsonl_lines(f):
            yield (
                parse_line(path, lineno, line)
                if line is not None
                else RawRecord(path, 1, "", None, EMPTY_FILE)
            )


def raw_records(path: str) -> Iterator[Union[RawRecord, Tuple[str, int, Optional[bytes]]]]:
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
        yield from ((path, lineno, line) for lineno, line in _jsonl_lines(f))


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
