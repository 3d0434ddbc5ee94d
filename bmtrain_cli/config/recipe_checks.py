"""validate-config's checks of train_config.recipe (a user's recipe file), read without running it: the
file exists, parses, and defines ``recipe(loaded, stream=None, on_step=None)`` at its top level; a built-in
recipe is the one of the config's stage. Called by config/checks.py."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable, Optional

from bmtrain_cli.config.schema import Config
from bmtrain_cli.methods import builtin_recipe_stage, method_of, recipe_path

KEY = "train_config.recipe"
SIGNATURE = "recipe(loaded, stream=None, on_step=None)"


def _recipe_function(tree: ast.Module) -> Optional[ast.FunctionDef]:
    found = None
    for node in tree.body:  # the last top-level definition wins, as when the module runs
        if isinstance(node, ast.FunctionDef) and node.name == "recipe":
            found = node
    return found


def _signature_problem(fn: ast.FunctionDef) -> str:
    """What ``recipe`` lacks to be called as recipe(loaded, stream=..., on_step=...) ("" if nothing)."""
    args = fn.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    if not positional and args.vararg is None:
        return "it takes no positional argument (the loaded config)"
    keywords = {a.arg for a in args.args + args.kwonlyargs}
    missing = [k for k in ("stream", "on_step") if k not in keywords and args.kwarg is None]
    if missing:
        return f"it takes no {' or '.join(missing)} argument"
    return ""


def check_recipe(config: Config, err: Callable[..., None]) -> None:
    t = config.train
    if t.recipe is None:
        return
    path = Path(t.recipe)
    example = f"a copy of {recipe_path('sft')}"
    if path.suffix != ".py":
        err(KEY, f"{t.recipe!r} is not a Python file (.py)", f"name a recipe file, e.g. {example}")
        return
    if not path.is_file():
        err(KEY, f"{t.recipe}: no such file", f"check the path (relative to {Path.cwd()}), or copy {example}")
        return
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
        where = f"{path}:{exc.lineno}" if isinstance(exc, SyntaxError) and exc.lineno else str(path)
        err(KEY, f"{where}: the recipe does not parse as Python ({exc.__class__.__name__}: {exc})")
        return
    fn = _recipe_function(tree)
    if fn is None:
        err(KEY, f"{t.recipe} defines no top-level {SIGNATURE}", f"start from {example}")
        return
    problem = _signature_problem(fn)
    if problem:
        err(KEY, f"{path}:{fn.lineno}: recipe() cannot be called as {SIGNATURE}: {problem}")
        return
    builtin = builtin_recipe_stage(path)
    if builtin and builtin != t.stage:
        err(
            KEY,
            f"{t.recipe} is the built-in recipe of stage {builtin}, and this config's stage is {t.stage}",
            f"run {recipe_path(method_of(t).recipe)} (or `bmtrain train` without --recipe), or set stage: "
            f"{builtin}",
        )
