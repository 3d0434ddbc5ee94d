"""One recipe per training method: train_config.stage picks a recipe through one registry
(bmtrain_cli/methods.py), and no library code branches on the stage (the registry and the config checks
that belong to a stage aside). The wheel carries every recipe file."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, get_args

import pytest

from bmtrain_cli.config.schema import TrainConfig
from bmtrain_cli.methods import METHODS, builtin_recipe_stage, method_of, recipe_file, recipe_path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "bmtrain_cli"
# where a stage may be compared: the registry, and the validation of a stage's settings
STAGE_ALLOWED = {
    "bmtrain_cli/methods.py",
    "bmtrain_cli/config/checks.py",
    "bmtrain_cli/config/preference_checks.py",
    "bmtrain_cli/config/grpo_checks.py",
    "bmtrain_cli/config/recipe_checks.py",
}
# the old second test of the method: an optional preference part consulted by the shared code
PREFERENCE_PART = re.compile(r"\bparts\.preference\b|\bpreference\s*=\s*None\b")


def _is_stage(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "stage") or (
        isinstance(node, ast.Name) and node.id == "stage"
    )


def _is_text(node: ast.AST) -> bool:
    """A string literal, or a tuple/list/set of them (``stage in ("sft", "dpo")``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_text(e) for e in node.elts)
    return False


def stage_branches(source: str, filename: str = "<source>") -> List[str]:
    """``file:line`` of every comparison of a ``stage`` (train_config.stage, a Workload's, a variable)
    with a method name (a string literal), and of every use of the preference part."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_stage(s) for s in sides) and any(_is_text(s) for s in sides):
                found.append(f"{filename}:{node.lineno}")
    for i, line in enumerate(source.splitlines(), 1):
        if PREFERENCE_PART.search(line):
            found.append(f"{filename}:{i}")
    return found


def test_the_branch_finder_sees_each_spelling():
    source = (
        'if t.stage == "dpo":\n    pass\n'
        'dpo = config.train.stage != "sft"\n'
        'x = stage in ("dpo", "grpo")\n'
        "y = parts.preference is not None\n"
        "if layout.stage == 3 or sharding_stage == 2 or stage == ctx.pp_rank:\n    pass\n"  # not methods
    )
    assert stage_branches(source, "f.py") == ["f.py:1", "f.py:3", "f.py:4", "f.py:5"]


def test_no_stage_branches_in_library_code():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel not in STAGE_ALLOWED:
            found += stage_branches(path.read_text(encoding="utf-8"), rel)
    assert found == [], (
        "library code branches on train_config.stage (look the method up in bmtrain_cli/methods.py, or "
        f"let the recipe pass what differs): {found}"
    )


def test_the_schema_offers_exactly_the_registered_stages():
    stage = TrainConfig.model_fields["stage"]
    assert set(get_args(stage.annotation)) == set(METHODS) and stage.default in METHODS


def test_every_stage_has_its_recipe_file_with_a_recipe_function():
    for stage, method in METHODS.items():
        path = recipe_path(method.recipe)
        assert path == REPO / "recipes" / f"{method.recipe}.py" and path.is_file(), stage
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name == "recipe" for n in tree.body), stage
        assert builtin_recipe_stage(path) == stage
        train = TrainConfig(stage=stage)
        assert method_of(train) is method and recipe_file(train) == path.resolve()


def test_a_named_recipe_file_replaces_the_stage_default(tmp_path):
    mine = tmp_path / "mine.py"
    assert recipe_file(TrainConfig(stage="dpo", recipe=str(mine))) == mine.resolve()
    assert builtin_recipe_stage(mine) == ""


def test_the_build_copies_every_recipe_into_the_package(tmp_path):
    from bmtrain_cli._build_kernels import copy_recipes

    names = copy_recipes(REPO / "recipes", tmp_path / "bmtrain_cli")
    shipped = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
    assert names == shipped and {f"{m.recipe}.py" for m in METHODS.values()} <= set(names)
    assert sorted(p.name for p in (tmp_path / "bmtrain_cli" / "_recipes").iterdir()) == shipped
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "sft.py").write_text("")
    with pytest.raises(RuntimeError, match="no recipe dpo"):
        copy_recipes(tmp_path / "partial", tmp_path / "out")
