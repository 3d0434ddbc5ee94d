"""Shared test fixtures."""

from __future__ import annotations

import os
import sys
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
