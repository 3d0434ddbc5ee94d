"""Streaming mode: exact resume, order independent of workers, epochs, ranks, compressed files, bad records."""

from __future__ import annotations

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.data.loader import build_loader
from bmtrain_cli.data.stream import DataError
from bmtrain_cli.errors import UserError

from .conftest import make_config


def _stream_config(tmp_path, **train):
    train.setdefault("streaming", True)
    train.setdefault("max_steps", 10)
    train.setdefault("data_workers", 0)
    train.setdefault("shuffle_buffer", 16)
    train.setdefault("micro_batch_size", 4)
    return make_config(tmp_path, **train)


def _take(it, n):
    return [{k: v.copy() for k, v in b.items()} for b in itertools.islice(it, n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def _keys(batch):
    """(tokens) of every sample of a batch, read back through the segment ids."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["attention_mask"][r]
        for s in np.unique(seg[seg > 0]):
            out.append(tuple(batch["input_ids"][r][seg == s].tolist()))
    return out


@pytest.fixture
def records():
    rng = np.random.default_rng(0)
    return [
        {"input": f"{a}+{b}=" * int(rng.integers(1, 4)), "output": str(a + b)}
        for a in range(9)
        for b in range(7)
    ]


@pytest.fixture
def data(write_jsonl, records):
    return write_jsonl(records)


def _all_samples(tmp_path, sp_tok, path):
    """Every sample of the file once, from the cached loader (the reference)."""
    cached = build_loader(make_config(tmp_path, data_path=path, micro_batch_size=1), sp_tok)
    return sorted(k for b in _take(iter(cached), len(cached)) for k in _keys(b))


@pytest.mark.parametrize("batching", ["longest", "packed", "max_length"])
def test_resume_gives_identical_next_batches(tmp_path, sp_tok, data, batching):
    cfg = _stream_config(tmp_path, data_path=data, batching=batching)
    ref = build_loader(cfg, sp_tok)
    expected = _take(iter(ref), 40)  # 63 records in chunks of 16: crosses chunk and epoch boundaries
    for cut in (1, 5, 17, 33):
        first = build_loader(cfg, sp_tok)
        got = _take(iter(first), cut)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        assert len(json.dumps(state)) < 2000  # offsets and counters, not samples
        resumed = build_loader(cfg, sp_tok)
        resumed.load_state_dict(state)
        got += _take(iter(resumed), 40 - cut)
        _same(got, expected)


@pytest.mark.slow  # starts worker processes
def test_order_does_not_depend_on_the_workers(tmp_path, sp_tok, data):
    inline = _take(iter(build_loader(_stream_config(tmp_path, data_path=data), sp_tok)), 30)
    ld = build_loader(_stream_config(tmp_path, data_path=data, data_workers=2), sp_tok)
    try:
        _same(_take(iter(ld), 30), inline)
    finally:
        ld.close()


def _epoch(ld, it):
    """The samples of the epoch the loader is in (micro_batch_size 1: a batch never spans two epochs)."""
    start, out = ld.epoch, []
    while ld.epoch == start:
        out += _keys(next(it))
    return out


def test_an_epoch_is_every_record_once_and_epochs_differ(tmp_path, sp_tok, data):
    ld = build_loader(_stream_config(tmp_path, data_path=data, micro_batch_size=1), sp_tok)
    it = iter(ld)
    first, second = _epoch(ld, it), _epoch(ld, it)
    everything = _all_samples(tmp_path, sp_tok, data)
    assert len(everything) == 63
    assert sorted(first) == everything and sorted(second) == everything
    assert first != second  # each buffer is permuted with (seed, buffer number)


def test_shuffle_mixes_only_within_the_buffer(tmp_path, sp_tok, write_jsonl):
    path = write_jsonl([{"input": f"{i}=", "output": str(i)} for i in range(40)])
    cfg = _stream_config(tmp_path, data_path=path, micro_batch_size=1, shuffle_buffer=10)
    got = [sp_tok.decode(list(b["input_ids"][0])) for b in _take(iter(build_loader(cfg, sp_tok)), 40)]
    chunks = [sorted(int(s.split("=")[0]) for s in got[i : i + 10]) for i in range(0, 40, 10)]
    assert chunks == [list(range(i, i + 10)) for i in range(0, 40, 10)]  # the buffer bounds the mixing
    assert [int(s.split("=")[0]) for s in got[:10]] != list(range(10))  # and it does shuffle


@pytest.mark.parametrize("batching", ["longest", "packed"])
def test_ranks_share_the_records_without_overlap(tmp_path, sp_tok, data, batching):
    world, seen = 3, []
    for r in range(world):
        cfg = _stream_config(tmp_path, data_path=data, micro_batch_size=1, batching=batching)
        ld = build_loader(cfg, sp_tok, data_rank=r, data_world=world)
        mine = _epoch(ld, iter(ld))
        assert len(mine) == 21  # record i goes to rank i % 3, then shuffled in the buffer
        seen += mine
    assert sorted(seen) == _all_samples(tmp_path, sp_tok, data)


def test_gz_files_and_globs_read_like_plain(tmp_path, sp_tok, records, write_jsonl):
    write_jsonl(records[:30], "a.jsonl")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in records[30:]) + "\n")
    pattern = str(tmp_path / "*.jsonl*")
    cfg = _stream_config(tmp_path, data_path=pattern, micro_batch_size=1)
    ld = build_loader(cfg, sp_tok)
    it = iter(ld)
    assert sorted(_epoch(ld, it)) == _all_samples(tmp_path, sp_tok, pattern)
    expected = _take(iter(build_loader(cfg, sp_tok)), 60)
    first = build_loader(cfg, sp_tok)
    head = _take(iter(first), 50)  # the position is inside the compressed file
    assert first.state_dict()["ranks"]["0"]["position"]["reader"]["cursors"][0]["file"] == 1
    resumed = build_loader(cfg, sp_tok)
    resumed.load_state_dict(first.state_dict())
    _same(head + _take(iter(resumed), 10), expected)


def test_zst_files(tmp_path, sp_tok, records, write_jsonl):
    zstandard = pytest.importorskip("zstandard")
    plain = write_jsonl(records)
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(Path(plain).read_bytes()))
    cfg = _stream_config(tmp_path, data_path=str(tmp_path / "d.jsonl.zst"), micro_batch_size=1)
    ld = build_loader(cfg, sp_tok)
    assert sorted(_epoch(ld, iter(ld))) == _all_samples(tmp_path, sp_tok, plain)


def test_bad_records_skip_and_log_once_across_a_resume(tmp_path, sp_tok, records, write_jsonl):
    lines = [json.dumps(r) for r in records[:40]]
    lines[5] = "{not json"
    lines[25] = json.dumps({"input": "x"})  # no output
    path = write_jsonl(lines)
    out = tmp_path / "out"
    out.mkdir()
    cfg = _stream_config(tmp_path, data_path=path, on_bad_record="skip", micro_batch_size=1)
    ld = build_loader(cfg, sp_tok)
    ld.start_rejected_log(str(out))
    got = _take(iter(ld), 30)
    state = ld.state_dict()
    _take(iter(ld), 20)  # the run goes on past the checkpoint, then is killed
    resumed = build_loader(cfg, sp_tok)
    resumed.load_state_dict(state)
    resumed.start_rejected_log(str(out))
    got += _take(iter(resumed), 8)
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(Path(r["file"]).name, r["line"]) for r in rejected] == [("data.jsonl", 6), ("data.jsonl", 26)]
    assert "invalid JSON" in rejected[0]["reason"] and "output" in rejected[1]["reason"]
    assert len({k for b in got for k in _keys(b)}) == 38
    assert resumed.stats()["rejected"] == 2


def test_a_bad_record_stops_at_the_step_boundary_before_its_buffer(tmp_path, sp_tok, records, write_jsonl):
    lines = [json.dumps(r) for r in records[:40]]
    lines[20] = json.dumps({"messages": []})  # in the second buffer of 16 records
    path = write_jsonl(lines)
    cfg = _stream_config(tmp_path, data_path=path, micro_batch_size=1, global_batch_size=3)
    ld = build_loader(cfg, sp_tok)
    assert ld.step_batches == 3
    it = iter(ld)
    taken = []
    with pytest.raises(DataError, match=r"data\.jsonl:21: field \"messages\" is empty"):
        while True:
            taken.append(next(it))
    assert len(taken) == 15  # the first buffer holds 16 samples; 15 = five whole steps of 3
    state = json.loads(json.dumps(ld.state_dict()))
    assert state["ranks"]["0"]["position"]["units"] == 15
    # continuing with on_bad_record: skip is the uninterrupted skip run from that step on
    skip_cfg = _stream_config(
        tmp_path, data_path=path, micro_batch_size=1, global_batch_size=3, on_bad_record="skip"
    )
    reference = _take(iter(build_loader(skip_cfg, sp_tok)), 30)
    _same(taken, reference[:15])
    resumed = build_loader(skip_cfg, sp_tok)
    resumed.load_state_dict(state)
    _same(_take(iter(resumed), 15), reference[15:])


def test_nothing_usable_and_json_arrays_are_refused(tmp_path, sp_tok, write_jsonl):
    bad = write_jsonl(["{oops"] * 5, "bad.jsonl")
    ld = build_loader(_stream_config(tmp_path, data_path=bad, on_bad_record="skip"), sp_tok)
    with pytest.raises(UserError, match="no usable record"):
        next(iter(ld))
    arr = tmp_path / "arr.json"
    arr.write_text(json.dumps([{"input": "1+1=", "output": "2"}]))
    with pytest.raises(UserError, match="JSON array"):  # when the loader is built, before training
        build_loader(_stream_config(tmp_path, data_path=str(arr)), sp_tok)


def test_resume_refuses_changed_data_or_mode(tmp_path, sp_tok, data, write_jsonl, records):
    cfg = _stream_config(tmp_path, data_path=data)
    ld = build_loader(cfg, sp_tok)
    _take(iter(ld), 3)
    state = ld.state_dict()
    with pytest.raises(UserError, match="shuffle_buffer"):
        build_loader(_stream_config(tmp_path, data_path=data, shuffle_buffer=8), sp_tok).load_state_dict(
            state
        )
    with pytest.raises(UserError, match="token cache"):
        build_loader(_stream_config(tmp_path, data_path=data), sp_tok).load_state_dict(
            {"epoch": 0, "offset": 3}
        )
    write_jsonl(records[:10])  # the same file, rewritten
    with pytest.raises(UserError, match="changed since the checkpoint"):
        build_loader(cfg, sp_tok).load_state_dict(state)


def test_mixing_weights_draw_in_proportion(tmp_path, sp_tok, write_jsonl):
    a = write_jsonl([{"input": "1+1=", "output": "2"}] * 10, "a.jsonl")
    b = write_jsonl([{"input": "9+9=", "output": "18"}] * 30, "b.jsonl")
    cfg = _stream_config(tmp_path, data_path=[a, b], data_weights=[3.0, 1.0], micro_batch_size=400)
    batch = _take(iter(build_loader(cfg, sp_tok)), 1)[0]
    seqs = [sp_tok.decode(r[m > 0]) for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    share = seqs.count("1+1=2") / len(seqs)
    assert len(seqs) == 400 and 0.70 < share < 0.80  # source a cycles 30 times, b 3 times


def test_auto_streams_large_data_only_with_max_steps(tmp_path, sp_tok, data, monkeypatch):
    from bmtrain_cli.data import stream_setup
    from bmtrain_cli.data.stream import StreamLoader

    monkeypatch.setattr(stream_setup, "STREAM_AUTO_BYTES", 1000)
    ld = build_loader(make_config(tmp_path, data_path=data, max_steps=3), sp_tok)
    assert isinstance(ld, StreamLoader) and "streaming: auto" in ld.stats()["line"]
    assert not isinstance(build_loader(make_config(tmp_path, data_path=data), sp_tok), StreamLoader)
    monkeypatch.setattr(stream_setup, "STREAM_AUTO_BYTES", 10**9)
    assert not isinstance(
        build_loader(make_config(tmp_path, data_path=data, max_steps=3), sp_tok), StreamLoader
    )


@pytest.mark.slow  # starts worker processes
def test_cache_built_by_workers_equals_inline(tmp_path, sp_tok, data):
    stores = []
    for workers in (0, 2):
        cfg = make_config(
            tmp_path, data_path=data, data_workers=workers, data_cache_dir=str(tmp_path / f"c{workers}")
        )
        stores.append(build_loader(cfg, sp_tok).dataset.stores[0])
    a, b = stores
    assert a.built and b.built
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.lines, b.lines)
