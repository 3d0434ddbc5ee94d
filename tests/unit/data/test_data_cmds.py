from __future__ import annotations

import json

from typer.testing import CliRunner

from bmtrain_cli.cli import app


def test_prepare_data_then_reuse_and_stats(tmp_path, sp_tok, demo_files, write_yaml):
    sp_tok.save(str(tmp_path / "tok"))
    cfg = write_yaml(
        f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n  max_seq_len: 8\n"
        f"train_config:\n  data_path: {demo_files[1]}\n  output_dir: {tmp_path / 'o'}\n"
        f"  data_cache_dir: {tmp_path / 'cache'}\n  micro_batch_size: 16\n"
    )
    runner = CliRunner()
    first = runner.invoke(app, ["prepare-data", "--config", cfg])
    assert first.exit_code == 0, first.output
    assert "500 samples" in first.output and "(tokenised)" in first.output
    again = runner.invoke(app, ["prepare-data", "--config", cfg])
    assert again.exit_code == 0 and "(reused)" in again.output
    res = runner.invoke(app, ["data-stats", "--config", cfg, "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert st["records"] == 500 and st["rejected"] == 0
    assert st["length"]["max"] >= st["length"]["p99"] >= st["length"]["p50"] > 0
    assert st["overlong"] == st["truncated"] > 0  # max_seq_len 8 is shorter than most samples
    w = st["padding_waste"]
    assert 0 <= w["packed"] <= w["longest"] <= w["max_length"] < 1
    text = runner.invoke(app, ["data-stats", "--config", cfg])
    assert "padding waste: max_length" in text.output and "token length:" in text.output
    # the per-file line counts the cached tokens, the summary the tokens left after truncation: say which
    assert f"{st['tokens']} tokens after truncation to max_seq_len 8 ({st['overlong']} samples longer)" in (
        again.output
    )
    assert f"tokens: {st['tokens']} after truncation to max_seq_len" in text.output


def test_data_stats_sample_draws_records_from_the_whole_file(tmp_path, sp_tok, write_jsonl, write_yaml):
    import gzip

    from bmtrain_cli.data.sample import sample_records

    path = write_jsonl([{"input": f"{i:04d}+0=", "output": f"{i:04d}"} for i in range(1000)])
    lines = open(path, "rb").read().splitlines(keepends=True)
    smp = sample_records([path], 300, seed=1)
    index = [lines.index(raw) for _, _, raw in smp.items]
    assert 250 <= len(set(index)) == len(index) <= 300  # each record at most once
    assert 400 < sum(index) / len(index) < 600 and min(index) < 100 and max(index) > 900  # not the head
    assert smp.read_through == []
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(b"".join(lines)))
    packed = sample_records([str(gz)], 50, seed=1)
    assert len(packed.items) == 50 and packed.read_through == [str(gz)]
    assert all(raw in lines for _, _, raw in packed.items)

    sp_tok.save(str(tmp_path / "tok"))
    cfg = write_yaml(
        f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n  max_seq_len: 64\n"
        f"train_config:\n  data_path: {path}\n  output_dir: {tmp_path / 'o'}\n  data_workers: 0\n"
        f"  data_cache_dir: {tmp_path / 'cache'}\n"
    )
    runner = CliRunner()
    full = json.loads(runner.invoke(app, ["data-stats", "--config", cfg, "--json"]).output)
    res = runner.invoke(app, ["data-stats", "--config", cfg, "--json", "--sample", "200"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert 150 <= st["sample"]["records"] <= 200 and st["records"] == st["sample"]["records"]
    assert abs(st["length"]["p50"] - full["length"]["p50"]) <= 1
    assert 900 <= st["sample"]["estimated_records"] <= 1100
    text = runner.invoke(app, ["data-stats", "--config", cfg, "--sample", "200"]).output
    assert text.startswith("sample: ") and "records drawn at random" in text
