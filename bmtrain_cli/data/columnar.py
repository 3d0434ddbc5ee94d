"""Tabular data files: CSV/TSV (a header row names the columns), Parquet (read row group by row group),
Arrow IPC files and Hugging Face ``datasets.save_to_disk`` directories.

Each row becomes one record (a dict of its columns) with its row number as the "line" (CSV: the line of
the file), so bad-record reports and rejected.jsonl name the file and row. Parquet and Arrow need pyarrow
(the ``parquet`` / ``arrow`` extra); CSV uses the standard library.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Iterator, List, Tuple

from bmtrain_cli.errors import UserError

COLUMNAR_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow")


def is_columnar(path: str) -> bool:
    return Path(path).suffix.lower() in COLUMNAR_SUFFIXES


def is_hf_dataset_dir(p: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk`` (state.json listing its .arrow files)."""
    return (p / "state.json").is_file() and any(p.glob("*.arrow"))


def hf_dataset_files(p: Path) -> List[str]:
    try:
        state = json.loads((p / "state.json").read_text(encoding="utf-8"))
        names = [d["filename"] for d in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{p}/state.json: not a datasets.save_to_disk state file ({exc})") from None
    return [str(p / n) for n in names]


def _pyarrow(path: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        extra = "parquet" if path.endswith(".parquet") else "arrow"
        raise UserError(f"{path}: reading it needs pyarrow: pip install 'bmtrain-cli[{extra}]'") from None
    return pyarrow


def _csv_rows(path: str) -> Iterator[Tuple[int, Any]]:
    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        for row in reader:
            yield reader.line_num, {k: v for k, v in row.items() if k is not None}


def _arrow_batches(path: str) -> Iterator[Any]:
    pa = _pyarrow(path)
    if path.lower().endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for g in range(pf.num_row_groups):  # one row group in memory at a time
            yield pf.read_row_group(g)
        return
    with pa.memory_map(path) as src:
        try:
            reader = pa.ipc.open_file(src)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            src.seek(0)
            batches = iter(pa.ipc.open_stream(src))  # datasets' save_to_disk writes the stream format
        yield from batches


def rows(path: str) -> Iterator[Tuple[int, Any]]:
    """(row number, record) of every row of a tabular file."""
    if path.lower().endswith((".csv", ".tsv")):
        yield from _csv_rows(path)
        return
    n = 0
    try:
        for batch in _arrow_batches(path):
            for rec in batch.to_pylist():
                n += 1
                yield n, rec
    except OSError as exc:
        raise UserError(f"{path}: cannot read it as {Path(path).suffix[1:]}: {exc}") from None
