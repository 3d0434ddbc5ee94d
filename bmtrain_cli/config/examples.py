"""The example configs: the checkout's ``configs/``, or the copy a built package carries.

``configs/`` stays the one place they are edited; a wheel carries them as ``bmtrain_cli/_configs`` (copied
at build time by bmtrain_cli/_build_kernels.py), so that `bmtrain init NAME` and ``--config NAME`` work
from a pip-installed package in an empty directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

PACKAGED_CONFIGS = "_configs"  # bmtrain_cli/_configs in a built package


def examples_dir() -> Optional[Path]:
    """Where the example configs are: the installed package's copy, else the checkout's configs/."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / PACKAGED_CONFIGS, package.parent / "configs"):
        if candidate.is_dir() and any(candidate.glob("*.yaml")):
            return candidate
    return None


def examples() -> Dict[str, Path]:
    """Example name (file name without .yaml) -> file."""
    root = examples_dir()
    return {p.stem: p for p in sorted(root.glob("*.yaml"))} if root else {}


def example_path(name: str) -> Optional[Path]:
    """The example config a bare name (``quickstart``, or ``quickstart.yaml``) stands for, if any."""
    stem = name[:-5] if name.endswith(".yaml") else name
    if "/" in stem or "\\" in stem:
        return None
    return examples().get(stem)


def describe(path: Path) -> str:
    """The first comment line of an example (what it does), without the leading '#'."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""
