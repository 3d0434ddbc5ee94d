"""Shared test fixtures."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
_session_dirs: list = []  # temporary folders this session made (removed at its end)


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def write_yaml(tmp_path):
    """Write a YAML text to a temporary file and return its path as str."""

    def _write(text: str, name: str = "config.yaml") -> str:
        p = tmp_path / name
        p.write_text(text, encoding="utf-8")
        return str(p)

    return _write


def pytest_configure(config):
    os.environ.setdefault("FLAGS_cudnn_deterministic", "1")
    # kernels: auto's measured choices (ops/choice.py) go to a record of this session, not the user's
    # tests compare runs with each other (a layout against one process, a resume against an uninterrupted
    # run) and with pinned figures: each run takes the static order, not a choice timed on this machine's
    # load (one process would time, several would not, and round-off would follow the timing). The tests
    # of `kernels: auto` itself remove the variable (tests/unit/ops, the plan's calibration).
    os.environ.setdefault("BMTRAIN_KERNEL_CHOICE", "static")
    if "BMTRAIN_KERNEL_CHOICES" not in os.environ:
        _session_dirs.append(tempfile.mkdtemp(prefix="bmtrain-kernels-"))
        os.environ["BMTRAIN_KERNEL_CHOICES"] = str(Path(_session_dirs[-1]) / "choices.json")


def pytest_unconfigure(config):
    for path in _session_dirs:
        shutil.rmtree(path, ignore_errors=True)
