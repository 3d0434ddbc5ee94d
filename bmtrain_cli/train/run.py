"""`bmtrain train` runs a recipe: train_config.recipe when the config names one (`--recipe PATH`), else
the built-in recipe of train_config.stage (bmtrain_cli/methods.py: recipes/sft.py, recipes/dpo.py; a
wheel carries them as bmtrain_cli/_recipes).

A recipe is a file a user reads and copies, torchtune-style, so it is loaded from its path rather than
imported as part of the package; a copy runs as ``python my_recipe.py --config C`` (cli.run_recipe_script)
and under `bmtrain run`, which launches the recipe file itself on every rank.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Optional, TextIO

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.errors import UserError
from bmtrain_cli.methods import METHODS, recipe_file, recipe_path

_LOADED: Dict[Path, ModuleType] = {}  # recipe file -> its module, loaded once per process


def _module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    return f"bmtrain_recipe_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def load_recipe_file(path: Path) -> ModuleType:
    """The recipe module of a file (loaded once per process; the script being run is that module)."""
    path = Path(path).resolve()
    if path in _LOADED:
        return _LOADED[path]
    if not path.is_file():
        raise UserError(f"the recipe {path} is missing")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"the recipe {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    _LOADED[path] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del _LOADED[path], sys.modules[name]
        raise
    return module


def load_recipe(stage: str = "sft") -> ModuleType:
    """The built-in recipe of a stage (recipes/STAGE.py, or the installed package's copy)."""
    if stage not in METHODS:
        raise ValueError(f"no recipe for stage {stage!r}; stages: {', '.join(METHODS)}")
    path = recipe_path(METHODS[stage].recipe)
    if not path.is_file():
        raise RuntimeError(f"the {stage} recipe is missing ({path}): reinstall bmtrain-cli")
    return load_recipe_file(path)


def run_training(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Dict[str, Any]:
    """Train with a loaded config through its recipe; returns summary.json's content. A run that fails
    before writing anything leaves no output directory behind (one that existed before is never touched)."""
    out = Path(loaded.config.train.output_dir)
    existed = out.exists()
    try:
        module = load_recipe_file(recipe_file(loaded.config.train))
        recipe = getattr(module, "recipe", None)
        if not callable(recipe):
            raise UserError(
                f"the recipe {module.__file__} defines no recipe(loaded, stream=None, on_step=None)"
            )
        return recipe(loaded, stream=stream)
    except BaseException:
        if not existed:
            _remove_if_empty(out)
        raise


def register_recipe(module: ModuleType) -> Path:
    """Make an already running module (a recipe run as a script) the one its file loads as; returns
    the file."""
    assert module.__file__ is not None
    path = Path(module.__file__).resolve()
    _LOADED[path] = module
    return path


def _remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` when it holds no file at any depth (only empty folders)."""
    if directory.is_dir() and not any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
        shutil.rmtree(directory, ignore_errors=True)
