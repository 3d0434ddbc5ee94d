"""Fixtures shared by the unit tests of several packages."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.quiet import import_paddle
from tests.robustness import run_config, write_arithmetic


@pytest.fixture(scope="session")
def robust_run(tmp_path_factory) -> Tuple[Path, Path, Path]:
    """(folder, output_dir, data) of a 2-step `bmtrain train` run (checkpoints step-1 and step-2) of the
    robustness suites; tests copy what they damage."""
    # Paddle's loggers keep the stream that is sys.stderr when Paddle is imported: import it here, not
    # inside a CliRunner invocation whose stream is closed afterwards (a later log line would then print
    # a "--- Logging error ---" traceback into another invocation's output)
    import_paddle()
    tmp = tmp_path_factory.mktemp("run")
    data = write_arithmetic(tmp / "train.jsonl")
    out = tmp / "out"
    res = CliRunner().invoke(app, ["train", "--config", run_config(tmp, out, data, 2)])
    assert res.exit_code == 0, res.output
    return tmp, out, data
