"""The README's command blocks, as a new user copies them: every `bmtrain <command>` named exists, the
venv is activated before the first bare `bmtrain`, and the cheap commands run (validate-config on the
shipped configs, schema, --help)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from bmtrain_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def bash_lines() -> List[str]:
    """Command lines of the README's ```bash blocks, comments stripped, in order."""
    text = README.read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def bmtrain_argvs() -> List[List[str]]:
    out = []
    for line in bash_lines():
        words = shlex.split(line.replace("|", " "))  # `--format a|b` is a choice, not a pipe
        if words and words[0] in ("bmtrain", ".venv/bin/bmtrain"):
            out.append(words[1:])
    return out


COMMANDS = {c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands}


def test_readme_names_only_commands_that_exist():
    argvs = bmtrain_argvs()
    assert len(argvs) >= 10
    for argv in argvs:
        assert argv and (argv[0] in COMMANDS or argv[0].startswith("--")), argv


def test_venv_is_activated_before_the_first_bare_bmtrain():
    lines = bash_lines()
    demo = lines.index(next(x for x in lines if x.startswith("make demo")))
    first = next(i for i, x in enumerate(lines) if x.startswith("bmtrain "))
    assert demo < first
    assert any(x in (". .venv/bin/activate", "source .venv/bin/activate") for x in lines[demo:first]), lines


def _run(argv: List[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def cheap_argvs() -> List[List[str]]:
    """validate-config on a shipped config and schema, as written; --help of every command named."""
    out = []
    for argv in bmtrain_argvs():
        if argv[0] == "validate-config" and (REPO / argv[1]).is_file():
            out.append(argv)
        elif argv[0] == "schema":
            out.append(["schema"])  # the README redirects it to a file; stdout is enough here
    out += [[name, "--help"] for name in sorted({a[0] for a in bmtrain_argvs() if not a[0].startswith("-")})]
    return out


@pytest.mark.parametrize("argv", cheap_argvs(), ids=lambda a: " ".join(a))
def test_cheap_readme_commands_run(argv):
    res = _run(argv)
    assert res.returncode == 0, (argv, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
