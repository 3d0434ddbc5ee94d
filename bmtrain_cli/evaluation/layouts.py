"""The published file layouts of the benchmarks, read into subjects of questions.

- mmlu: headerless CSVs ``question,A,B,C,D,answer``, ``<subject>_dev.csv`` (few-shot) and
  ``<subject>_test.csv`` (scored), anywhere under the directory (the release has dev/ and test/);
- ceval: CSVs with the header ``id,question,A,B,C,D,answer(,explanation)``, ``<subject>_dev.csv`` and
  ``<subject>_val.csv`` (scored: the release's test split has no answers);
- cmmlu: CSVs with the header ``,Question,A,B,C,D,Answer``, ``dev/<subject>.csv`` and ``test/<subject>.csv``;
- multiple_choice: JSONL records ``{"question", "choices": [...], "answer": index or letter}``,
  ``<subject>_dev.jsonl`` (few-shot, optional) and ``<subject>_test.jsonl`` (or any other ``*.jsonl``).
"""

from __future__ import annotations

import csv
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from bmtrain_cli.errors import UserError

LETTERS = string.ascii_uppercase


@dataclass(frozen=True)
class Question:
    question: str
    choices: Tuple[str, ...]
    answer: int  # index into choices


@dataclass
class Subject:
    name: str
    test: List[Question] = field(default_factory=list)
    dev: List[Question] = field(default_factory=list)


def _answer(value: str, n: int, where: str) -> int:
    value = str(value).strip()
    if value.isdigit() and int(value) < n:
        return int(value)
    if len(value) == 1 and value.upper() in LETTERS[:n]:
        return LETTERS.index(value.upper())
    raise UserError(f"{where}: answer {value!r} is not one of {', '.join(LETTERS[:n])} (or 0..{n - 1})")


def _csv_rows(path: Path, header: bool) -> List[Question]:
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if header:
        rows = rows[1:]
    out = []
    for line, row in enumerate(rows, start=2 if header else 1):
        where = f"{path}:{line}"
        if header:  # C-Eval: id,question,A..D,answer(,explanation); CMMLU: (index),Question,A..D,Answer
            row = row[1:7]
        if len(row) < 6:
            raise UserError(f"{where}: expected question, 4 choices and the answer, got {len(row)} fields")
        out.append(Question(row[0], tuple(row[1:5]), _answer(row[5], 4, where)))
    return out


def _jsonl_rows(path: Path) -> List[Question]:
    out = []
    for line, text in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        where = f"{path}:{line}"
        try:
            rec = json.loads(text)
            choices = tuple(str(c) for c in rec["choices"])
            question = str(rec["question"])
            answer = rec["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(f"{where}: a record needs question, choices and answer ({exc})") from None
        if not 2 <= len(choices) <= len(LETTERS):
            raise UserError(f"{where}: {len(choices)} choices (2 to {len(LETTERS)} are read)")
        out.append(Question(question, choices, _answer(str(answer), len(choices), where)))
    return out


def _files(root: Path, pattern: str) -> List[Path]:
    return sorted(root.rglob(pattern)) if root.is_dir() else ([root] if root.match(pattern) else [])


def _split_by_suffix(
    root: Path, ext: str, test_suffix: str, reader: Callable[[Path], List[Question]]
) -> Dict[str, Subject]:
    """``<subject>_dev<ext>`` and ``<subject><test_suffix><ext>`` files (a file: it and its dev beside it)."""
    subjects: Dict[str, Subject] = {}
    for path in _files(root, f"*{test_suffix}{ext}"):
        name = path.name[: -len(test_suffix + ext)]
        subjects[name] = Subject(name, test=reader(path))
    search = root if root.is_dir() else root.parent.parent
    for path in sorted(search.rglob(f"*_dev{ext}")):
        name = path.name[: -len("_dev" + ext)]
        if name in subjects:
            subjects[name].dev = reader(path)
    return subjects


def _cmmlu(root: Path) -> Dict[str, Subject]:
    base = root if root.is_dir() else root.parent.parent
    tests = sorted((base / "test").glob("*.csv")) if root.is_dir() else [root]
    subjects = {p.stem: Subject(p.stem, test=_csv_rows(p, header=True)) for p in tests}
    for name, subject in subjects.items():
        dev = base / "dev" / f"{name}.csv"
        if dev.is_file():
            subject.dev = _csv_rows(dev, header=True)
    return subjects


def _generic(root: Path) -> Dict[str, Subject]:
    subjects = _split_by_suffix(root, ".jsonl", "_test", _jsonl_rows)
    if not subjects:  # any JSONL file is a subject of its own, scored whole
        for path in _files(root, "*.jsonl"):
            if not path.name.endswith("_dev.jsonl"):
                subjects[path.stem] = Subject(path.stem, test=_jsonl_rows(path))
    return subjects


READERS: Dict[str, Callable[[Path], Dict[str, Subject]]] = {
    "mmlu": lambda root: _split_by_suffix(root, ".csv", "_test", lambda p: _csv_rows(p, header=False)),
    "ceval": lambda root: _split_by_suffix(root, ".csv", "_val", lambda p: _csv_rows(p, header=True)),
    "cmmlu": _cmmlu,
    "multiple_choice": _generic,
}


def read_task(task: str, data_path: Path, subjects: Optional[List[str]] = None) -> List[Subject]:
    """The subjects of ``task`` under ``data_path`` (a directory, or one subject's scored file)."""
    if task not in READERS:
        raise UserError(f"--task {task}: known tasks are {', '.join(READERS)}")
    if not data_path.exists():
        raise UserError(f"--data_path {data_path} does not exist")
    found = READERS[task](data_path)
    if subjects:
        unknown = sorted(set(subjects) - set(found))
        if unknown:
            raise UserError(f"--subject {', '.join(unknown)}: not under {data_path}")
        found = {k: v for k, v in found.items() if k in subjects}
    if not found or not any(s.test for s in found.values()):
        raise UserError(f"no {task} questions under {data_path} (docs/eval.md lists the file layouts)")
    return [found[k] for k in sorted(found)]
