"""CSV/TSV, Parquet, Arrow and datasets.save_to_disk directories read as records with their row numbers."""

from __future__ import annotations

import json

import pytest

from bmtrain_cli.data.formats import parse_record
from bmtrain_cli.data.readers import raw_records, read_records, resolve_source

ROWS = [{"instruction": f"Add {i} and 1", "input": "", "output": str(i + 1)} for i in range(5)]


def test_csv_and_tsv(tmp_path):
    for name, sep in (("d.csv", ","), ("d.tsv", "\t")):
        p = tmp_path / name
        lines = [sep.join(ROWS[0])] + [sep.join(r.values()) for r in ROWS]
        p.write_text("\n".join(lines) + "\n", encoding="utf-8")
        recs = list(read_records(str(p)))
        assert [r.line for r in recs] == [2, 3, 4, 5, 6]  # the header is line 1
        assert parse_record(recs[3].value).messages[-1] == ("assistant", "4")
        assert [json.loads(raw) for _, _, raw in raw_records(str(p))] == ROWS


def test_parquet_row_groups_and_arrow(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    assert pq.ParquetFile(tmp_path / "d.parquet").num_row_groups == 3
    recs = list(read_records(str(tmp_path / "d.parquet")))
    assert [r.value for r in recs] == ROWS and [r.line for r in recs] == [1, 2, 3, 4, 5]
    hf = tmp_path / "hf"
    hf.mkdir()
    with pa.OSFile(str(hf / "data-00000-of-00001.arrow"), "wb") as sink:  # save_to_disk's stream format
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
    (hf / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    (hf / "dataset_info.json").write_text("{}")
    files = resolve_source(str(hf))
    assert files == [str(hf / "data-00000-of-00001.arrow")]
    assert [r.value for r in read_records(files[0])] == ROWS
