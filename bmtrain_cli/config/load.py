"""Load a config: safe YAML with line numbers -> dotted overrides -> pydantic validation -> checks.

Every command uses :func:`load_config`. Problems are collected, mapped back to the file's line and
column (PyYAML's compose() keeps a start mark on every node) and raised together as a ConfigError.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from bmtrain_cli.config.examples import example_path
from bmtrain_cli.config.schema import SECTION_MODELS, Config
from bmtrain_cli.errors import ConfigError, Problem

Loc = Tuple[str, ...]
Pos = Tuple[str, Optional[int], Optional[int]]  # (source, line, column), 1-based

SECTION_SYNONYMS = {"parallel": "parallel_config"}
_EXAMPLES_HINT = "`bmtrain init quickstart` writes quickstart.yaml (`bmtrain init` lists the examples)"
# Scalars, lists and mappings a config may hold once its aliases are expanded (shipped configs: < 200).
MAX_YAML_VALUES = 100_000


class _StrictSafeLoader(yaml.SafeLoader):
    """SafeLoader that also refuses duplicate keys (a silent override is a classic config bug)."""


def _construct_mapping(loader: _StrictSafeLoader, node: yaml.MappingNode, deep: bool = False) -> Dict:
    seen: Dict[Any, yaml.Node] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r} (first defined on line {seen[key].start_mark.line + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node
    return loader.construct_mapping(node, deep=deep)


_StrictSafeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


@dataclass
class LoadedConfig:
    """A validated, frozen config plus the warnings found while checking it."""

    config: Config
    source: str
    warnings: List[Problem] = field(default_factory=list)
    overrides: Tuple[str, ...] = ()


def _positions(node: Optional[yaml.Node], source: str) -> Dict[Loc, Pos]:
    """Map every key path of a YAML document to the position of its key (or list item). A node reached
    again through an alias is not walked again: errors inside it point at the alias."""
    out: Dict[Loc, Pos] = {}
    walked: Set[int] = set()

    def walk(n: yaml.Node, loc: Loc) -> None:
        if id(n) in walked:
            return
        walked.add(id(n))
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = str(k.value)
                child = loc + (key,)
                out[child] = (source, k.start_mark.line + 1, k.start_mark.column + 1)
                out[child + ("<value>",)] = (source, v.start_mark.line + 1, v.start_mark.column + 1)
                walk(v, child)
        elif isinstance(n, yaml.SequenceNode):
            for i, item in enumerate(n.value):
                out[loc + (str(i),)] = (source, item.start_mark.line + 1, item.start_mark.column + 1)
                walk(item, loc + (str(i),))

    if node is not None:
        out[()] = (source, node.start_mark.line + 1, node.start_mark.column + 1)
        walk(node, ())
    return out


def _check_expansion(node: yaml.Node, source: str) -> None:
    """Refuse a document whose aliases expand to more than MAX_YAML_VALUES values (a "billion laughs"
    alias bomb: a few lines that expand to billions) or refer to themselves, before anything walks the
    expanded tree. Sizes are counted once per node, so this is linear in the text."""
    sizes: Dict[int, int] = {}
    open_nodes: Set[int] = set()

    def refuse(n: yaml.Node, what: str) -> None:
        raise ConfigError(
            [
                Problem(
                    f"invalid YAML: {what}",
                    file=source,
                    line=n.start_mark.line + 1,
                    column=n.start_mark.column + 1,
                    suggestion="write the values out; a config needs no deep aliases",
                )
            ]
        )

    def size(n: yaml.Node) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if id(n) in open_nodes:
            refuse(n, "a YAML alias refers to the list or mapping that contains it (recursive alias)")
        open_nodes.add(id(n))
        if isinstance(n, yaml.MappingNode):
            children = [c for pair in n.value for c in pair]
        elif isinstance(n, yaml.SequenceNode):
            children = list(n.value)
        else:
            children = []
        total = 1
        for child in children:
            total += size(child)
            if total > MAX_YAML_VALUES:
                refuse(n, f"the aliases expand to more than {MAX_YAML_VALUES:,} values (an alias bomb?)")
        open_nodes.discard(id(n))
        sizes[id(n)] = total
        return total

    size(node)


def parse_yaml(text: str, source: str) -> Tuple[Dict[str, Any], Dict[Loc, Pos]]:
    """Parse YAML safely; return (data, positions) or raise ConfigError naming line and column."""
    try:
        node = yaml.compose(text, Loader=_StrictSafeLoader)
        if node is not None:
            _check_expansion(node, source)
        loader = _StrictSafeLoader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        msg = " ".join(str(x) for x in (exc.context, exc.problem) if x)
        suggestion = None
        if "could not determine a constructor" in msg or "python/" in msg:
            msg = f"unsafe or unknown YAML tag refused ({exc.problem})"
            suggestion = "configs are read with a safe loader: write plain values, not Python objects"
        raise ConfigError(
            [
                Problem(
                    f"invalid YAML: {msg}",
                    file=source,
                    line=mark.line + 1 if mark else None,
                    column=mark.column + 1 if mark else None,
                    suggestion=suggestion,
                )
            ]
        ) from None
    except yaml.YAMLError as exc:  # unmarked errors (rare)
        raise ConfigError([Problem(f"invalid YAML: {exc}", file=source)]) from None
    except RecursionError:
        raise ConfigError(
            [Problem("invalid YAML: lists or mappings nested too deeply", file=source)]
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    f"the config must be a mapping of sections, got {type(data).__name__}",
                    file=source,
                    line=1,
                    column=1,
                    suggestion="start with `model_config:`, `train_config:` or `parallel_config:`",
                )
            ]
        )
    return data, _positions(node, source)


def _parse_override(item: str) -> Tuple[Loc, Any]:
    if "=" not in item:
        raise ConfigError(
            [
                Problem(
                    f"--set {item!r}: expected key.path=value",
                    file="--set",
                    suggestion="e.g. --set train_config.max_steps=10",
                )
            ]
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError([Problem(f"--set {item!r}: empty key", file="--set")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return tuple(key.split(".")), value


def apply_overrides(
    data: Dict[str, Any], positions: Dict[Loc, Pos], overrides: Iterable[str]
) -> Dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars/lists) to a nested dict."""
    for item in overrides:
        loc, value = _parse_override(item)
        top = SECTION_SYNONYMS.get(loc[0], loc[0])
        if top == "parallel_config" and "parallel_config" not in data and "parallel" in data:
            top = "parallel"
        loc = (top,) + loc[1:]
        node = data
        for i, part in enumerate(loc[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(
                    [Problem(f"--set {item!r}: {'.'.join(loc[: i + 1])} is not a section", file="--set")]
                )
            node = nxt
        node[loc[-1]] = value
        for j in range(1, len(loc) + 1):
            positions[loc[:j]] = ("--set " + item, None, None)
        positions[loc + ("<value>",)] = ("--set " + item, None, None)
    return data


def _model_for(loc: Loc) -> Optional[type]:
    """The pydantic model that owns the mapping at ``loc`` (for unknown-key suggestions)."""
    if len(loc) == 0:
        return Config
    if len(loc) == 1:
        return SECTION_MODELS.get(SECTION_SYNONYMS.get(loc[0], loc[0]))
    return None


def _field_names(model: type) -> List[str]:
    if model is Config:
        return list(SECTION_MODELS) + list(SECTION_SYNONYMS)
    assert issubclass(model, BaseModel)
    return list(model.model_fields)


def locate(positions: Dict[Loc, Pos], loc: Sequence[str], value: bool = False) -> Pos:
    """Position of the longest known prefix of ``loc``."""
    loc = tuple(str(x) for x in loc)
    if value and loc + ("<value>",) in positions:
        return positions[loc + ("<value>",)]
    for n in range(len(loc), 0, -1):
        if loc[:n] in positions:
            return positions[loc[:n]]
    return (positions.get((), ("<config>", None, None))[0], None, None)


def _short_input(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem_from_pydantic(
    err: ErrorDetails, positions: Dict[Loc, Pos], file_section: Dict[str, str]
) -> Problem:
    loc: Loc = tuple(str(x) for x in err["loc"] if not str(x).startswith("function-"))
    # pydantic reports union members (e.g. "str", "list[str]") as loc parts; drop them.
    loc = tuple(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "bool", "float"))
    if loc and loc[0] in file_section:  # the file wrote `parallel:`; point at what the user wrote
        loc = (file_section[loc[0]],) + loc[1:]
    kind = err["type"]
    source, line, col = locate(positions, loc, value=kind != "extra_forbidden")
    path = ".".join(loc)
    msg = err["msg"]
    suggestion = None
    if kind == "extra_forbidden":
        parent, key = loc[:-1], loc[-1] if loc else ""
        model = _model_for(parent)
        msg = f"unknown key {key!r}"
        if model is not None:
            names = _field_names(model)
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            if close:
                suggestion = f"did you mean {close[0]}?"
            else:
                where = ".".join(parent) or "the top level"
                suggestion = f"valid keys in {where}: {', '.join(names)}"
    elif kind in ("literal_error", "enum"):
        expected = err.get("ctx", {}).get("expected", "")
        msg = f"{msg}, got {_short_input(err.get('input'))}"
        if isinstance(err.get("input"), str) and expected:
            options = [o.strip(" '\"") for o in expected.replace(" or ", ",").split(",")]
            close = difflib.get_close_matches(err["input"], options, n=1, cutoff=0.5)
            if close:
                suggestion = f"did you mean {close[0]!r}?"
    elif kind == "missing":
        msg = "required field is missing"
    elif kind.startswith("value_error") or kind == "assertion_error":
        msg = msg.removeprefix("Value error, ")
    else:
        msg = f"{msg}, got {_short_input(err.get('input'))}"
    return Problem(msg, path=path, file=source, line=line, column=col, suggestion=suggestion)


def validate_data(data: Dict[str, Any], positions: Dict[Loc, Pos]) -> Config:
    """Validate a parsed dict into a frozen Config, mapping every error to its place."""
    data = dict(data)
    file_section: Dict[str, str] = {}
    problems: List[Problem] = []
    for short, full in SECTION_SYNONYMS.items():
        if short in data:
            if full in data:
                src, line, col = locate(positions, (short,))
                problems.append(
                    Problem(
                        f"both `{short}` and `{full}` are given",
                        path=short,
                        file=src,
                        line=line,
                        column=col,
                        suggestion=f"`{short}` is a synonym of `{full}`: keep one",
                    )
                )
                data.pop(short)  # validate the rest, so every other problem is reported too
                continue
            data[full] = data.pop(short)
            file_section[full] = short
    for name, section in data.items():
        if name in SECTION_MODELS and section is not None and not isinstance(section, dict):
            src, line, col = locate(positions, (file_section.get(name, name),), value=True)
            problems.append(
                Problem(
                    f"section must be a mapping of keys, got {type(section).__name__}",
                    path=file_section.get(name, name),
                    file=src,
                    line=line,
                    column=col,
                )
            )
        elif name in SECTION_MODELS and section is None:
            data[name] = {}
    if any(p.message.startswith("section must be") for p in problems):
        raise ConfigError(problems)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems += [_problem_from_pydantic(e, positions, file_section) for e in exc.errors()]
        partial, emptied = _without_bad_fields(data, exc)
        err = ConfigError(problems, partial=partial)
        err.emptied_sections = emptied  # type: ignore[attr-defined]
        raise err from None
    if problems:
        raise ConfigError(problems, partial=config)
    return config


def _without_bad_fields(data: Dict[str, Any], exc: ValidationError) -> Tuple[Optional[Config], Set[str]]:
    """Best effort: the config with every failing field dropped, so cross-field checks still run and
    the user sees all problems at once. Also returns the sections replaced by their defaults (an error of
    the section as a whole): cross-field checks on those would judge defaults, not the user's values."""
    import copy

    emptied: Set[str] = set()
    pruned = copy.deepcopy(data)
    for e in exc.errors():
        loc = [str(x) for x in e["loc"]]
        node: Any = pruned
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict) and loc and loc[-1] in node:
            del node[loc[-1]]
            if len(loc) == 1:
                emptied.add(loc[0])
        elif len(loc) == 1 and loc[0] in pruned:
            pruned[loc[0]] = {}
            emptied.add(loc[0])
    try:
        return Config.model_validate(pruned), emptied
    except ValidationError:
        return None, emptied


def read_config_file(path: str) -> Tuple[Dict[str, Any], Dict[Loc, Pos], str]:
    """(data, positions, source) of a config file; a bare example name (``quickstart``) that is no file
    here is the packaged example of that name."""
    p = Path(path)
    source = str(path) or str(p)  # an empty --config is the current directory
    example = None if p.exists() else example_path(str(path))
    if example is not None:  # `--config quickstart`
        p, source = example, str(example)
    if not p.exists():
        hint = f"check the path; {_EXAMPLES_HINT}"
        raise ConfigError([Problem("config file not found", file=source, suggestion=hint)])
    if p.is_dir():
        raise ConfigError([Problem("is a directory, expected a YAML file", file=source)])
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [Problem(f"not UTF-8 text ({exc.reason} at byte {exc.start})", file=source)]
        ) from None
    except OSError as exc:
        raise ConfigError([Problem(f"cannot read: {exc.strerror}", file=source)]) from None
    data, positions = parse_yaml(text, source)
    return data, positions, source


def load_config(
    path: Optional[str],
    overrides: Sequence[str] = (),
    *,
    mode: str = "validate",
    world_size: Optional[int] = None,
    has_gpu: Optional[bool] = None,
    require_data: bool = False,
) -> LoadedConfig:
    """Load, override, validate and check a config file.

    mode: "validate" treats machine-dependent issues (bf16 on a CPU-only Paddle, a checkpoint path not
    present here) as warnings; "train" makes them errors. require_data: refuse a data_path or
    eval_data_path that names no file here (`bmtrain validate-config`). Raises ConfigError with every
    problem found.
    """
    from bmtrain_cli.config.checks import check_config, missing_data
    from bmtrain_cli.data.registry import expand_registry

    data: Dict[str, Any] = {}
    positions: Dict[Loc, Pos] = {}
    source = "<defaults>"  # no file: the defaults alone (tests, `bmtrain plan` without a file)
    if path is not None:
        data, positions, source = read_config_file(path)
        if not data and not overrides:  # all defaults, no data: a wrong or truncated file, not a config
            raise ConfigError(
                [
                    Problem(
                        "the config file is empty (no settings)",
                        file=source,
                        suggestion=f"start from an example: {_EXAMPLES_HINT}",
                    )
                ]
            )
    data = apply_overrides(data, positions, overrides)
    data = expand_registry(data)  # LLaMA-Factory's dataset_info.json names -> data_path
    emptied: Set[str] = set()
    try:
        config = validate_data(data, positions)
        early: List[Problem] = []
    except ConfigError as exc:
        if not isinstance(exc.partial, Config):  # None: nothing valid to check further
            raise
        config, early = exc.partial, exc.problems
        emptied = getattr(exc, "emptied_sections", set())
    problems = check_config(config, mode=mode, world_size=world_size, has_gpu=has_gpu)
    if require_data:
        problems += missing_data(config)
    if early and emptied:
        problems = [p for p in problems if not (p.path and p.path.split(".")[0] in emptied)]
    if early:  # a cross-field finding about a refused field would judge its default, not the user's value
        refused = [prob.path.split(".")[-1] for prob in early if prob.path and "." in prob.path]
        named = re.compile(r"\b(" + "|".join(map(re.escape, refused)) + r")\b") if refused else None
        problems = [p for p in problems if named is None or not named.search(p.message)]
    file_section = (
        {"parallel_config": "parallel"} if "parallel" in data and "parallel_config" not in data else {}
    )
    placed = []
    for prob in problems:
        loc = tuple(prob.path.split(".")) if prob.path else ()
        if loc and loc[0] in file_section:
            loc = (file_section[loc[0]],) + loc[1:]
        src, line, col = locate(positions, loc, value=True)
        if src.startswith("--set") or line is not None or prob.file is None:
            prob = Problem(
                prob.message,
                path=".".join(loc),
                file=prob.file or src,
                line=prob.line if prob.line is not None else line,
                column=prob.column if prob.column is not None else col,
                suggestion=prob.suggestion,
                severity=prob.severity,
            )
        placed.append(prob)
    errors = early + [p for p in placed if p.severity == "error"]
    if errors:
        raise ConfigError(errors + [p for p in placed if p.severity != "error"])
    return LoadedConfig(config=config, source=source, warnings=placed, overrides=tuple(overrides))
