"""Build-time hook (pyproject.toml ``[tool.setuptools.cmdclass]``): a wheel carries the kernel sources.

The top-level ``kernels/`` directory stays the one place the C++/CUDA sources are edited. When setuptools
builds the package (``pip wheel .``, ``pip install .``), this ``build_py`` copies its sources into
``bmtrain_cli/_kernels/`` of the build tree (never of the checkout), so an installed package finds them
there (``bmtrain_cli.ops.build.KERNELS_DIR``) and builds the extension on first use into the user cache.
Imported by setuptools only; it must not import Paddle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

from setuptools.command.build_py import build_py

PACKAGED = "_kernels"  # bmtrain_cli/_kernels in a built package (ops/build.py looks there first)
SUFFIXES = (".cc", ".cu", ".h")


def kernel_files(root: Path) -> List[Path]:
    """The kernel sources under ``root`` (kernels/): C++ (.cc), CUDA (.cu) and headers, relative paths."""
    return sorted(
        p.relative_to(root) for p in root.rglob("*") if p.suffix in SUFFIXES and "build" not in p.parts
    )


class BuildPyWithKernels(build_py):
    """setuptools' build_py, then the kernel sources copied into the built package."""

    def run(self) -> None:
        super().run()
        root = Path(__file__).resolve().parents[1] / "kernels"
        files = kernel_files(root) if root.is_dir() else []
        if not files:
            raise RuntimeError(f"no kernel sources under {root}: build from a full checkout")
        target = Path(self.build_lib) / "bmtrain_cli" / PACKAGED
        for rel in files:
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, target / rel)
