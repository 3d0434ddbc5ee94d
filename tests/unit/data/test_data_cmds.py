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
