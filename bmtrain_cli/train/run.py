"""`bmtrain train` runs the training recipe, recipes/train.py (the wheel carries it as bmtrain_cli/_recipes).

The recipe is a file a user reads and copies, torchtune-style, so it is loaded from its path rather than
imported as part of the package.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Optional, TextIO

from bmtrain_cli.config.load import LoadedConfig

_PACKAGE = Path(__file__).resolve().parents[1]


def recipe_path(name: str) -> Path:
    """An installed package's copy (bmtrain_cli/_recipes/NAME.py), else the checkout's recipes/NAME.py."""
    packaged = _PACKAGE / "_recipes" / f"{name}.py"
    return packaged if packaged.is_file() else _PACKAGE.parent / "recipes" / f"{name}.py"


def load_recipe(name: str = "train") -> ModuleType:
    """The recipe module (loaded once per process, as ``bmtrain_recipe_NAME``)."""
    module_name = f"bmtrain_recipe_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    path = recipe_path(name)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise RuntimeError(f"the {name} recipe is missing ({path}): reinstall bmtrain-cli")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_training(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Dict[str, Any]:
    """Train with a loaded config through the recipe; returns summary.json's content. A run that fails
    before writing anything leaves no output directory behind (one that existed before is never touched)."""
    out = Path(loaded.config.train.output_dir)
    existed = out.exists()
    try:
        return load_recipe("train").recipe(loaded, stream=stream)
    except BaseException:
        if not existed:
            _remove_if_empty(out)
        raise


def _remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` when it holds no file at any depth (only empty folders)."""
    if directory.is_dir() and not any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
        shutil.rmtree(directory, ignore_errors=True)
