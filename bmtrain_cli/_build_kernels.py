"""Build-time hook (pyproject.toml ``[tool.setuptools.cmdclass]``): a wheel carries the kernel sources, the
recipes and the example configs.

The top-level ``kernels/`` and ``recipes/`` directories stay the one place the C++/CUDA sources and the
training recipes are edited. When setuptools builds the package (``pip wheel .``, ``pip install .``), this
``build_py`` copies them into ``bmtrain_cli/_kernels/`` and ``bmtrain_cli/_recipes/`` of the build tree
(never of the checkout), so an installed package finds them there (``bmtrain_cli.ops.build.KERNELS_DIR``
builds the extension on first use into the user cache; ``bmtrain_cli.train.run`` loads the recipe that
`bmtrain train` runs). The example configs of ``configs/`` go to ``bmtrain_cli/_configs/``
(``bmtrain_cli.config.examples``: `bmtrain init`, ``--config quickstart``). Imported by setuptools only; it must not import Paddle.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List

from setuptools.command.build_py import build_py

PACKAGED = "_kernels"  # bmtrain_cli/_kernels in a built package (ops/build.py looks there first)
PACKAGED_RECIPES = "_recipes"  # bmtrain_cli/_recipes in a built package (train/run.py looks there first)
PACKAGED_CONFIGS = (
    "_configs"  # bmtrain_cli/_configs in a built package (config/examples.py looks there first)
)
SUFFIXES = (".cc", ".cu", ".h")


def kernel_files(root: Path) -> List[Path]:
    """The kernel sources under ``root`` (kernels/): C++ (.cc), CUDA (.cu) and headers, relative paths."""
    return sorted(
        p.relative_to(root) for p in root.rglob("*") if p.suffix in SUFFIXES and "build" not in p.parts
    )


def _methods() -> Dict[str, Any]:
    """bmtrain_cli/methods.py's METHODS, read by path: the build backend runs before bmtrain_cli is
    importable (methods.py imports only the standard library)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().with_name("methods.py")
    spec = importlib.util.spec_from_file_location("_bmtrain_build_methods", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return dict(module.METHODS)


def copy_recipes(recipes: Path, package: Path) -> List[str]:
    """Every recipe file of ``recipes`` (recipes/) into ``package``/_recipes; each training method's
    (bmtrain_cli/methods.py) must be there. Returns the names copied."""
    missing = [m.recipe for m in _methods().values() if not (recipes / f"{m.recipe}.py").is_file()]
    if missing:
        raise RuntimeError(f"no recipe {', '.join(missing)} under {recipes}: build from a full checkout")
    target = package / PACKAGED_RECIPES
    target.mkdir(parents=True, exist_ok=True)
    names = []
    for path in sorted(recipes.glob("*.py")):
        shutil.copy2(path, target / path.name)
        names.append(path.name)
    return names


class BuildPyWithKernels(build_py):
    """setuptools' build_py, then the kernel sources and the recipes copied into the built package."""

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
        copy_recipes(Path(__file__).resolve().parents[1] / "recipes", Path(self.build_lib) / "bmtrain_cli")
        configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
        if not configs:
            raise RuntimeError("no example configs under configs/: build from a full checkout")
        target = Path(self.build_lib) / "bmtrain_cli" / PACKAGED_CONFIGS
        target.mkdir(parents=True, exist_ok=True)
        for path in configs:
            shutil.copy2(path, target / path.name)
