"""Streaming under data parallel (2 ranks, `bmtrain run`): a bad record only rank 1 reads stops both
ranks at the same step with one checkpoint holding both ranks' positions, and resuming it with
on_bad_record: skip gives the losses of an uninterrupted 2-rank run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.test_stream_kill_resume import CONFIG, demo  # noqa: F401 - the fixture
from tests.integration.test_train_kill_resume import _losses

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def _run(cfg, *extra):
    return subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "run", "--config", str(cfg), *extra],
        capture_output=True,
        text=True,
        timeout=400,
    )


def test_two_ranks_stop_together_and_resume_exactly(tmp_path, demo):  # noqa: F811
    data, tok = demo
    lines = data.read_text().splitlines()
    lines[99] = "{broken"  # record 99: rank 1's (99 % 2), in its second buffer of 40
    bad = tmp_path / "train.jsonl"
    bad.write_text("\n".join(lines) + "\n")

    def config(name, on_bad):
        cfg = tmp_path / f"{name}.yaml"
        text = CONFIG.format(tok=tok, data=bad, workers=1, on_bad=on_bad, out=tmp_path / name)
        cfg.write_text(
            text.replace("max_steps: 12", "max_steps: 8") + "parallel_config:\n  data_parallel: 2\n"
        )
        return cfg

    ref = _run(config("ref", "skip"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _losses(tmp_path / "ref")
    assert sorted(reference) == list(range(1, 9))

    cfg = config("strict", "error")
    stopped = _run(cfg)
    assert stopped.returncode != 0
    text = stopped.stdout + stopped.stderr
    assert f"{bad}:100: invalid JSON" in text and "stopped at step 5/8" in text
    state = json.loads((tmp_path / "strict" / "checkpoints" / "step-5" / "trainer_state.json").read_text())
    ranks = state["data"]["ranks"]
    assert sorted(ranks) == ["0", "1"] and ranks["0"]["position"] != ranks["1"]["position"]

    resumed = _run(cfg, "--resume", "--set", "train_config.on_bad_record=skip")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _losses(tmp_path / "strict") == reference
