"""Every option of every command, mutated (issue 18): wrong types, signs, zero, huge and non-finite numbers,
missing paths, a directory where a file is expected and a file where a directory is, empty and odd text
(a lone surrogate, as an undecodable byte of argv arrives), unknown options, missing required ones. Each
must end in exit 0, or exit 2 with a short message; never a traceback, never a change to a file the
command should not touch: the working folder (config, data, tokenizer, a run with its checkpoints, both
export formats) is hashed before and after every case. On exit 0 a command may only add files inside
its output (train's output_dir, export's --output, schema's --output) and the token cache; a refused
command adds nothing but cache files.

Damaged export files (paddle-inference and hf) through `generate` and `eval` are below.
docs/training.md ("Guarantees") states what these check.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import typer.main
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.export.pipeline import export_checkpoint
from tests.robustness import FILE_MUTATIONS, assert_clean_exit, write_arithmetic
from tests.tiny import model_yaml
from tests.tree import tree_digest

# ----------------------------------------------------------------------------- the working folder

CONFIG = (
    model_yaml(max_seq_len=24, kv_heads=None, tokenizer_path="{ws}/tok")
    + """train_config:
  data_path: {ws}/data.jsonl
  output_dir: {ws}/out
  data_cache_dir: {ws}/cache
  max_steps: 1
  micro_batch_size: 4
  save_steps: 1
  num_workers: 0
"""
)
CHECKPOINT = "run/checkpoints/step-2"
CACHE = "cache"


@pytest.fixture(scope="module")
def workspace(robust_run, tmp_path_factory) -> Path:
    """A folder with everything a command reads: config.yaml, data.jsonl, tok/ (the run's tokenizer),
    run/ (the 2-step run), pi/ and hf/ (its step-2 exported in both formats), and odd things to point
    options at: adir/ (empty), afile.txt, empty.txt, garbage.bin."""
    _, out, _ = robust_run
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(out, ws / "run")
    shutil.copytree(out / "tokenizer", ws / "tok")
    write_arithmetic(ws / "data.jsonl")
    (ws / "config.yaml").write_text(CONFIG.format(ws=ws), encoding="utf-8")
    for fmt, name in (("paddle-inference", "pi"), ("hf", "hf")):
        export_checkpoint(str(ws / CHECKPOINT), str(ws / name), fmt=fmt, log=lambda m: None)
    (ws / "adir").mkdir()
    (ws / "afile.txt").write_text("not what was asked for\n", encoding="utf-8")
    (ws / "empty.txt").write_bytes(b"")
    (ws / "garbage.bin").write_bytes(bytes(range(256)) * 8)
    return ws


def _changes(before: Dict[str, str], after: Dict[str, str]) -> Tuple[List[str], List[str]]:
    """(paths added, paths modified or removed)."""
    added = sorted(set(after) - set(before))
    touched = sorted(k for k in before if after.get(k) != before[k])
    return added, touched


def _under(path: str, prefixes: Sequence[str]) -> bool:
    return any(p in ("", ".") or path == p or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def _makes_room(path: str, outputs: Sequence[str]) -> bool:
    """``path`` is inside an output, or a folder created on the way to one."""
    return _under(path, outputs) or any(o.startswith(path + "/") for o in outputs)


def _remove_added(ws: Path, added: List[str]) -> None:
    """Put the folder back as it was before a case that exited 0 (its outputs go; the cache stays)."""
    for rel in added:  # sorted: a folder comes before what it holds
        p = ws / rel
        if _under(rel, [CACHE]) or not (p.exists() or p.is_symlink()):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def invoke_case(
    ws: Path, args: List[str], outputs: Sequence[str], what: str, replaces: bool = False
) -> Optional[str]:
    """Run one case in ``ws``; None when it ended cleanly, else what went wrong. ``outputs``: the paths
    (relative to ``ws``) the command may add to when it succeeds (and replace, with ``replaces``)."""
    before = tree_digest(ws)
    res = CliRunner().invoke(app, args)
    try:
        assert_clean_exit(res, what)
    except AssertionError as exc:
        return str(exc)
    added, touched = _changes(before, tree_digest(ws))
    allowed = [CACHE, *outputs] if res.exit_code == 0 else [CACHE]
    stray = [p for p in added if not _makes_room(p, allowed)]
    if res.exit_code == 0 and replaces:
        touched = [p for p in touched if not _under(p, outputs)]
    if res.exit_code == 0 and not stray:
        _remove_added(ws, added)
    if touched or stray:
        return f"{what}: exit {res.exit_code} changed {touched} added {stray}\n{res.output}"
    return None


# ----------------------------------------------------------------------------- command options

INT = ["abc", "", "-1", "0", "1.5", "99999999999999999999999", "nan"]
FLOAT = ["abc", "", "-1", "0", "1e308", "inf", "-inf", "nan"]
IN_FILE = ["missing.jsonl", "adir", "", "empty.txt", "garbage.bin"]
IN_DIR = ["missing", "afile.txt", "adir", "", "data.jsonl"]
OUT_DIR = ["afile.txt", "adir", "new/sub/dir", "", "run", CHECKPOINT, "pi"]
OUT_FILE = ["adir", "missing/sub/schema.json", "", "afile.txt"]
TEXT = ["", "bogus", "\udcff", "x" * 5000]
SIZE = ["abc", "", "0", "-80GiB", "nanGiB", "infGiB", "1e400GiB", "80XB"]
SET = ["nokey", "=", "train_config.max_steps=abc", "train_config.nope=1", "model_config=1", "max_steps=-5"]
FLAG = ["twice", "with a value"]
KINDS: Dict[str, List[str]] = {
    "int": INT,
    "float": FLOAT,
    "in_file": IN_FILE,
    "in_dir": IN_DIR,
    "out_dir": OUT_DIR,
    "out_file": OUT_FILE,
    "text": TEXT,
    "size": SIZE,
    "set": SET,
    "flag": FLAG,
}

# command: (arguments that work, {option: kind}, the options naming what it writes, its default output)
COMMANDS: Dict[str, Tuple[List[str], Dict[str, str], Tuple[str, ...], Tuple[str, ...]]] = {
    "validate-config": (
        ["config.yaml"],
        {"CONFIG": "in_file", "--config": "in_file", "--set": "set", "--json": "flag"},
        (),
        (),
    ),
    "schema": ([], {"--output": "out_file"}, ("--output",), ()),
    "prepare-data": (
        ["--config", "config.yaml"],
        {"--config": "in_file", "--data_path": "in_file", "--tokenizer": "in_dir", "--set": "set"},
        (),
        (),
    ),
    "data-stats": (
        ["--config", "config.yaml"],
        {
            "--config": "in_file",
            "--data_path": "in_file",
            "--tokenizer": "in_dir",
            "--set": "set",
            "--json": "flag",
            "--sample": "int",
        },
        (),
        (),
    ),
    "data-preview": (
        ["--config", "config.yaml"],
        {
            "--config": "in_file",
            "-n": "int",
            "--data_path": "in_file",
            "--tokenizer": "in_dir",
            "--set": "set",
        },
        (),
        (),
    ),
    "train": (
        ["--config", "config.yaml"],
        {
            "--config": "in_file",
            "--data_path": "in_file",
            "--output_dir": "out_dir",
            "--set": "set",
            "--resume": "flag",
            "--overwrite": "flag",
            "--recipe": "in_file",
        },
        ("--output_dir",),
        ("out",),
    ),
    "run": (
        ["--config", "config.yaml", "--dry_run"],
        {
            "--config": "in_file",
            "--nproc_per_node": "int",
            "--nnodes": "int",
            "--ips": "text",
            "--master": "text",
            "--log_dir": "out_dir",
            "--dry_run": "flag",
        },
        (),
        (),
    ),
    "plan": (
        ["--config", "config.yaml"],
        {
            "--config": "in_file",
            "--gpus": "int",
            "--gpu_memory": "size",
            "--nodes": "int",
            "--device": "text",
            "--search": "flag",
            "--top": "int",
            "--json": "flag",
            "--set": "set",
        },
        (),
        (),
    ),
    "generate": (
        ["--model_path", CHECKPOINT, "--prompt", "1+1=", "--max_new_tokens", "2"],
        {
            "--model_path": "in_dir",
            "--prompt": "text",
            "--max_new_tokens": "int",
            "--temperature": "float",
            "--top_p": "float",
            "--chat": "flag",
            "--template": "text",
            "--seed": "int",
            "--tokenizer_path": "in_dir",
            "--dtype": "text",
        },
        (),
        (),
    ),
    "chat": (  # stdin is empty under CliRunner: the chat ends at once
        ["--model_path", CHECKPOINT, "--max_new_tokens", "2"],
        {
            "--model_path": "in_dir",
            "--adapter": "in_dir",
            "--max_new_tokens": "int",
            "--temperature": "float",
            "--top_p": "float",
            "--seed": "int",
            "--system": "text",
            "--template": "text",
            "--tokenizer_path": "in_dir",
            "--dtype": "text",
        },
        (),
        (),
    ),
    "eval": (
        ["--model_path", CHECKPOINT, "--data_path", "data.jsonl"],
        {
            "--model_path": "in_dir",
            "--data_path": "in_file",
            "--json": "flag",
            "--batch_size": "int",
            "--max_seq_len": "int",
            "--template": "text",
            "--data_format": "text",
            "--tokenizer_path": "in_dir",
            "--dtype": "text",
            "--exact_match": "flag",
            "--max_new_tokens": "int",
            "--task": "text",
            "--num_fewshot": "int",
            "--subject": "text",
        },
        (),
        (),
    ),
    "export": (
        ["--checkpoint", CHECKPOINT, "--output", "exported"],
        {
            "--checkpoint": "in_dir",
            "--output": "out_dir",
            "--format": "text",
            "--quantize": "text",
            "--eval_data": "in_file",
            "--template": "text",
            "--overwrite": "flag",
            "--merge": "flag",
            "--quantize-embeddings": "flag",
            "--max-eval-records": "int",
        },
        ("--output",),
        ("exported",),
    ),
}
# cases that train or export: run with -m slow
SLOW = {"train", "export"}
# an existing file named by `schema --output` is replaced (it names a file to write, not a folder)
REPLACES = {"schema"}


def _options(command: str) -> Dict[str, List[str]]:
    """{first option name (or CONFIG for an argument): all its names} of a command of the CLI."""
    click_cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    out = {}
    for p in click_cmd.params:
        if p.name in ("help",):
            continue
        names = [o for o in p.opts + p.secondary_opts]
        out[names[0] if names[0].startswith("-") else p.name.upper()] = names
    return out


# Commands that run until stopped, so a mutation that is accepted would never end; tested elsewhere.
LONG_RUNNING = {
    "serve": "tests/unit/serve starts it as a process and stops it",
    "init": "tests/test_cli_init.py: it writes into the current directory, which this table's cases do not track",
}


def test_the_table_covers_every_option_of_every_command():
    cli = typer.main.get_command(app)
    assert sorted(COMMANDS) == sorted(set(cli.commands) - set(LONG_RUNNING))  # type: ignore[attr-defined]
    for command, (_, kinds, _, _) in COMMANDS.items():
        assert sorted(kinds) == sorted(_options(command)), command


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_base_arguments_work(workspace, monkeypatch, command):
    """The control: every command's unmutated arguments exit 0 and change only its outputs."""
    monkeypatch.chdir(workspace)
    base, _, _, default_out = COMMANDS[command]
    res = CliRunner().invoke(app, [command, *base])
    assert res.exit_code == 0, res.output
    problem = invoke_case(workspace, [command, *base], default_out, f"{command} (base)")
    assert problem is None, problem


def _mutate(base: List[str], option: str, names: List[str], kind: str, value: str) -> List[str]:
    """``base`` with ``option`` set to ``value`` (replaced where ``base`` has it)."""
    if not option.startswith("-"):  # the positional argument (CONFIG, NAME)
        return [value, *base[1:]]
    if kind == "flag":
        flag = names[0]
        return [*base, flag, flag] if value == "twice" else [*base, f"{flag}=1"]
    args = list(base)
    for i, a in enumerate(args[:-1]):
        if a in names:
            args[i + 1] = value
            return args
    return [*args, option, value]


CASES = [
    pytest.param(c, o, marks=pytest.mark.slow if c in SLOW else (), id=f"{c} {o}")
    for c, (_, kinds, _, _) in COMMANDS.items()
    for o in kinds
]


@pytest.mark.parametrize("command, option", CASES)
def test_every_option_mutation_ends_cleanly(workspace, monkeypatch, command, option):
    monkeypatch.chdir(workspace)
    base, kinds, writers, default_out = COMMANDS[command]
    names = _options(command)[option]
    problems = []
    for value in KINDS[kinds[option]]:
        args = _mutate(base, option, names, kinds[option], value)
        outputs = [args[args.index(w) + 1] for w in writers if w in args] or list(default_out)
        what = f"{command} {args}"
        problems.append(invoke_case(workspace, [command, *args], outputs, what, command in REPLACES))
    problems = [p for p in problems if p]
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_unknown_and_missing_options_are_usage_errors(workspace, monkeypatch, command):
    monkeypatch.chdir(workspace)
    base, _, _, _ = COMMANDS[command]
    problems = [invoke_case(workspace, [command, *base, "--no-such-option"], (), f"{command} unknown")]
    for i, a in enumerate(base):
        if a.startswith("--") and i + 1 < len(base) and not base[i + 1].startswith("--"):
            args = base[:i] + base[i + 2 :]
            problems.append(invoke_case(workspace, [command, *args], (), f"{command} without {a}"))
    problems = [p for p in problems if p]
    assert not problems, "\n\n".join(problems)


# ----------------------------------------------------------------------------- damaged exports

FAST_DAMAGE = {"truncated at half", "garbage"}  # the rest runs with -m slow
EXPORT_FILES = {
    "pi": [
        "bmtrain_export.json",
        "config.json",
        "model.json",
        "model.pdiparams",
        "tokenizer.model",
        "tokenizer_config.json",
    ],
    "hf": [
        "bmtrain_export.json",
        "config.json",
        "model.safetensors",
        "tokenizer.model",
        "tokenizer_config.json",
    ],
}
# damage that leaves a usable model: the export's own record (read for its format; the files decide)
HARMLESS = {"bmtrain_export.json", "tokenizer_config.json"}


def test_the_export_file_lists_are_complete(workspace):
    for name, files in EXPORT_FILES.items():
        assert sorted(p.name for p in (workspace / name).iterdir()) == sorted(files), name


EXPORT_CASES = [
    pytest.param(e, f, m, marks=() if m in FAST_DAMAGE else pytest.mark.slow, id=f"{e}-{f}-{m}")
    for e, files in EXPORT_FILES.items()
    for f in files
    for m in FILE_MUTATIONS
]


@pytest.mark.parametrize("export, name, mutation", EXPORT_CASES)
def test_a_damaged_export_file_is_refused_by_generate_and_eval(workspace, tmp_path, export, name, mutation):
    """A truncated model.pdiparams gave a traceback and exit 1 (issue 18 item 8). Every file of both
    export formats, damaged: `generate` and `eval` exit 2 naming the export (or its file), or work where
    the file only describes the export; nothing in it changes."""
    model = tmp_path / export
    shutil.copytree(workspace / export, model)
    FILE_MUTATIONS[mutation](model / name)
    data = shutil.copy(workspace / "data.jsonl", tmp_path / "data.jsonl")
    before = tree_digest(tmp_path)
    for args in (
        ["generate", "--model_path", str(model), "--prompt", "1+1=", "--max_new_tokens", "2"],
        ["eval", "--model_path", str(model), "--data_path", str(data)],
    ):
        res = CliRunner().invoke(app, args)
        what = f"{args[0]} {export}/{name} {mutation}"
        assert_clean_exit(res, what)
        if name not in HARMLESS:
            assert res.exit_code == 2, f"{what}: a damaged export was used\n{res.output}"
            assert str(model) in res.output or name in res.output, f"{what}: {res.output}"
    assert tree_digest(tmp_path) == before


def test_train_refuses_to_replace_its_own_config(workspace, monkeypatch):
    """`bmtrain train --output_dir ''` (or `.`) beside config.yaml replaced the user's config with the
    resolved one (the run writes output_dir/config.yaml): refused before anything is written."""
    monkeypatch.chdir(workspace)
    for out in ("", ".", str(workspace)):
        before = tree_digest(workspace)
        res = CliRunner().invoke(app, ["train", "--config", "config.yaml", "--output_dir", out])
        assert res.exit_code == 2 and "replaces with the resolved config" in res.output, res.output
        assert tree_digest(workspace) == before
