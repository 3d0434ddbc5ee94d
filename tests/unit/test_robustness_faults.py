"""Faults of the environment (issue 28): two runs on one output_dir, a full disk or an unwritable path at
every write of a save, an export and a token-cache build, symlinked and read-only paths, a kill between
any two filesystem operations of a save. Each must end with one line (exit 2), the last complete
checkpoint resumable and nothing half-written under a real name.
docs/training.md ("Guarantees") states what these check.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.checkpoint_layout import (
    LOCK_ENV,
    LOCK_FILE,
    STATE_FILE,
    OutputDirLock,
    atomic_directory,
    find_latest,
    point_latest,
    remove_stale_temporaries,
)
from bmtrain_cli.cli import app
from bmtrain_cli.errors import UserError
from tests.robustness import assert_clean_exit, run_config
from tests.tree import tree_digest

ROOT = Path(__file__).resolve().parents[2]

HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from bmtrain_cli.checkpoint_layout import own_output_dir
    with own_output_dir(Path(sys.argv[1])):
        print("held", flush=True)
        time.sleep(60)
    """
)


def _holder(out: Path) -> subprocess.Popen:
    """Another process holding ``out`` the way `bmtrain train` does."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(LOCK_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- one run per output_dir


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--overwrite"]], ids=["train", "resume", "overwrite"])
def test_a_second_run_on_a_held_output_dir_is_refused(robust_run, tmp_path, flags):
    tmp, out, data = robust_run
    run = tmp_path / "out"
    shutil.copytree(out, run)
    before = tree_digest(run)
    proc = _holder(run)
    try:
        res = CliRunner().invoke(app, ["train", "--config", run_config(tmp_path, run, data, 3), *flags])
    finally:
        proc.kill()
        proc.wait()
    assert_clean_exit(res, f"train {flags} on a held output_dir")
    assert res.exit_code == 2
    assert f"in use by another run (pid {proc.pid} on " in res.output and "since " in res.output
    after = tree_digest(run)
    after.pop(LOCK_FILE, None)  # the killed holder's (stale) lock file
    assert after == before


def test_a_lock_of_a_dead_process_is_stale(tmp_path):
    out = tmp_path / "out"
    proc = _holder(out)
    proc.kill()
    proc.wait()
    assert (out / LOCK_FILE).is_file()  # left by the kill, no longer held
    with OutputDirLock(out):
        assert f"pid={os.getpid()} " in (out / LOCK_FILE).read_text()
    assert not (out / LOCK_FILE).exists()


def test_a_lock_held_by_an_orphan_of_a_dead_process_is_stale(tmp_path):
    """A data worker that outlived its trainer still holds the open lock file: the recorded pid is dead,
    so the next run takes a fresh lock file."""
    out = tmp_path / "out"
    out.mkdir()
    lock = OutputDirLock(out).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK_FILE).write_text(f"pid={dead.pid} host={os.uname().nodename} since=x\n")
    try:
        with OutputDirLock(out):
            assert f"pid={os.getpid()} " in (out / LOCK_FILE).read_text()
    finally:
        lock._close()


def test_the_lock_is_the_jobs_under_a_launcher(tmp_path, monkeypatch):
    """A rank started by `bmtrain run` (LOCK_ENV names the output_dir its launcher holds) does not take
    the lock again; any other output_dir it still must."""
    from bmtrain_cli.checkpoint_layout import own_output_dir

    out = tmp_path / "out"
    with own_output_dir(out):
        assert os.environ[LOCK_ENV] == os.path.realpath(out)
        with own_output_dir(out):  # what a rank does
            pass
        with pytest.raises(UserError, match="in use by another run"):
            OutputDirLock(out).acquire()
    assert LOCK_ENV not in os.environ
    assert not out.exists()  # created for the run and left empty: removed


def test_an_unwritable_output_dir_is_one_line(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o500)
    try:
        with pytest.raises(UserError, match="is not writable"):
            OutputDirLock(out).acquire()
    finally:
        out.chmod(0o700)


# ----------------------------------------------------------------------------- a kill inside a save


class Killed(BaseException):
    """The process died here (raised by the fault hook; the test looks at the tree as it was then)."""


def _complete_step(root: Path, name: str, tag: str) -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "weights.safetensors").write_text(tag)
    (d / STATE_FILE).write_text(tag)


def _save_step_again(root: Path, tag: str) -> None:
    """What save_checkpoint does to the filesystem when step-2 already exists (a resume at a saved step)."""
    final = root / "step-2"
    with atomic_directory(final, f".tmp-step-2-{os.getpid()}") as tmp:
        (tmp / "weights.safetensors").write_text(tag)
        (tmp / STATE_FILE).write_text(tag)
    point_latest(root, final)


FS_OPS = [(os, "rename"), (os, "replace"), (os, "fsync"), (os, "unlink"), (os, "mkdir"), (shutil, "rmtree")]


def _save_killed_at(tmp_path: Path, k: int, monkeypatch) -> Path:
    """Run the save with a kill just before its k-th filesystem operation; returns a copy of the
    checkpoints folder as the kill left it (None when the save has fewer operations)."""
    root = tmp_path / f"run-{k}" / "checkpoints"
    _complete_step(root, "step-1", "one")
    _complete_step(root, "step-2", "old")
    point_latest(root, root / "step-2")
    snapshot = tmp_path / f"killed-{k}"
    count = [0]
    copying = [False]
    with monkeypatch.context() as m:
        for mod, name in FS_OPS:
            real = getattr(mod, name)

            def hooked(*a, _real=real, **kw):
                if copying[0]:
                    return _real(*a, **kw)
                if count[0] == k:
                    copying[0] = True
                    shutil.copytree(root, snapshot, symlinks=True)  # the tree as the kill leaves it
                    raise Killed
                count[0] += 1
                return _real(*a, **kw)

            m.setattr(mod, name, hooked)
        try:
            _save_step_again(root, "new")
        except Killed:
            return snapshot
    return None


def test_a_kill_between_any_two_operations_of_a_save_keeps_a_complete_step(tmp_path, monkeypatch):
    killed_points = 0
    for k in range(200):
        snapshot = _save_killed_at(tmp_path, k, monkeypatch)
        if snapshot is None:
            break
        killed_points += 1
        remove_stale_temporaries(snapshot)  # what the next start does (after restore_replaced)
        latest = find_latest(snapshot)
        assert latest is not None and latest.name == "step-2", f"kill before operation {k}: {latest}"
        assert (latest / STATE_FILE).read_text() in ("old", "new"), f"kill before operation {k}"
        assert (latest / "weights.safetensors").read_text() == (latest / STATE_FILE).read_text()
        assert not [p for p in snapshot.iterdir() if p.name.startswith(".")], f"kill before operation {k}"
    assert killed_points >= 5  # mkdir, fsyncs, both renames, the rmtree of the replaced copy
