"""Shared test fixtures."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


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
    os.environ.setdefault(
        "BMTRAIN_KERNEL_CHOICES", str(Path(tempfile.mkdtemp(prefix="bmtrain-kernels-")) / "choices.json")
    )
