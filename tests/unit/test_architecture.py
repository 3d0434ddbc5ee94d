"""The shape of the package, measured from its source: no import cycles (every import counts, including
those inside functions and under TYPE_CHECKING) and no oversized modules."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

PACKAGE = Path(__file__).resolve().parents[2] / "bmtrain_cli"
MAX_LINES = 500
# Files allowed over MAX_LINES, each with the reason; the list only shrinks.
LINE_ALLOWANCE: Set[str] = set()
MAX_FUNCTION_LINES = 80
# Functions allowed over MAX_FUNCTION_LINES ("path::name"), each with the reason; the list only shrinks.
FUNCTION_ALLOWANCE = {
    "bmtrain_cli/config/checks.py::check_config": "one flat list of independent rules, one `if` each",
    "bmtrain_cli/plan/estimator.py::_stage_estimate": "one memory model top to bottom, ~40 terms feeding each other",
    "bmtrain_cli/commands/model_cmds.py::register": "typer registration: the commands are nested functions",
    "bmtrain_cli/commands/plan_cmd.py::register": "typer registration: the command is a nested function",
    "bmtrain_cli/commands/plan_cmd.py::plan": "the `bmtrain plan` command: its typer options are most of it",
    "bmtrain_cli/commands/model_cmds.py::eval_cmd": "the `bmtrain eval` command: its typer options are most of it",
    "bmtrain_cli/config/load.py::load_config": "read, merge overrides, validate, check, freeze: each step named",
    "bmtrain_cli/parallel/cpu_compat.py::_build_pylayers": "four small PyLayer classes built after import",
    "bmtrain_cli/parallel/pipeline.py::_build_items": "the pipeline stage classes, defined where paddle is imported",
}


def package_modules(root: Path = PACKAGE) -> Dict[str, Path]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    out: Dict[str, Path] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _owning_module(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.AST, modules: Dict[str, Path]) -> List[str]:
    """Our modules an import statement in ``module`` loads (``from pkg import sub`` loads pkg.sub)."""
    if isinstance(node, ast.Import):
        found = [_owning_module(alias.name, modules) for alias in node.names]
        return [m for m in found if m]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:  # relative import
        here = module.split(".")
        package = here if modules[module].name == "__init__.py" else here[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        target = full if full in modules else _owning_module(base, modules)
        if target:
            out.append(target)
    return out


def _importlib_target(node: ast.AST, modules: Dict[str, Path]) -> Optional[str]:
    """Our module an ``importlib.import_module("bmtrain_cli....")`` call with a literal name loads."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    arg = node.args[0].value
    if name != "import_module" or not isinstance(arg, str):
        return None
    return _owning_module(arg, modules)


def import_graph(root: Path = PACKAGE) -> Dict[str, Set[str]]:
    """module -> our modules it imports anywhere in its source."""
    modules = package_modules(root)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(d for d in _imported(name, node, modules) if d != name)
            elif target := _importlib_target(node, modules):
                deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_sees_a_function_level_and_a_type_checking_cycle(tmp_path):
    pkg = tmp_path / "bmtrain_cli"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from bmtrain_cli.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n"
    )
    (pkg / "sub" / "c.py").write_text("from bmtrain_cli.sub.a import f\n")
    assert cycles(import_graph(pkg)) == [["bmtrain_cli.sub.a", "bmtrain_cli.sub.b"]]


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "bmtrain_cli.parallel.context" in graph["bmtrain_cli.parallel.topology"]
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n    " + "\n    ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c)
        for c in found
    )


def folder_of(module: str) -> str:
    """The folder of the package a module lives in (a top-level module is a folder of its own)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else module


def folder_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Cycles between folders: the module graph collapsed to one node per folder."""
    folders: Dict[str, Set[str]] = {}
    for module, deps in graph.items():
        here = folder_of(module)
        folders.setdefault(here, set()).update(folder_of(d) for d in deps if folder_of(d) != here)
    return cycles({f: {d for d in deps if d in folders} for f, deps in folders.items()})


def test_the_folder_cycle_finder_sees_an_importlib_loop(tmp_path):
    pkg = tmp_path / "bmtrain_cli"
    for sub in ("x", "y"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "x" / "a.py").write_text("from bmtrain_cli.y import b\n")
    (pkg / "y" / "b.py").write_text("import importlib\nimportlib.import_module('bmtrain_cli.x.a')\n")
    assert folder_cycles(import_graph(pkg)) == [["x", "y"]]


def test_no_folder_cycles():
    graph = import_graph()
    found = folder_cycles(graph)
    assert not found, "folders importing each other (move the shared piece below them):\n" + "\n".join(
        " <-> ".join(c)
        + "\n    "
        + "\n    ".join(
            f"{m} -> {d}"
            for m, deps in sorted(graph.items())
            for d in sorted(deps)
            if folder_of(m) in c and folder_of(d) in c and folder_of(d) != folder_of(m)
        )
        for c in found
    )


def test_no_module_over_the_line_budget():
    root = PACKAGE.parent
    sizes = {
        str(p.relative_to(root)): len(p.read_text(encoding="utf-8").splitlines())
        for p in PACKAGE.rglob("*.py")
    }
    over = {f: n for f, n in sizes.items() if n > MAX_LINES and f not in LINE_ALLOWANCE}
    assert not over, f"modules over {MAX_LINES} lines (split them by what they hold): {over}"
    stale = [f for f in LINE_ALLOWANCE if sizes.get(f, 0) <= MAX_LINES]
    assert not stale, f"allowed oversized modules that are no longer oversized (drop them): {stale}"


def test_no_function_over_the_line_budget():
    root = PACKAGE.parent
    over = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                key = f"{path.relative_to(root)}::{node.name}"
                if lines > MAX_FUNCTION_LINES and key not in FUNCTION_ALLOWANCE:
                    over[key] = lines
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (split them, or allow one with its reason): {over}"
    )
