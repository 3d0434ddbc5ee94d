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


# ----------------------------------------------------------------------------- a full disk at every write


class _DiskFull:
    """Make the k-th write of the block fail as a full disk does: an open for writing, a rename, an
    fsync (OSError ENOSPC), a safetensors save (SafetensorError "... (os error 28)") or a numpy save
    (numpy's short write "N requested and M written")."""

    def __init__(self, monkeypatch, k: int, under: object = None):
        self.k, self.count, self.hit = k, 0, False
        import builtins
        import io

        import numpy as np
        import safetensors.numpy as stn
        from safetensors import SafetensorError

        def fail(kind: str, filename: object) -> None:
            if under is not None and not str(filename).startswith(str(under)):
                return  # only the device of ``under`` is full
            if self.hit or self.count != self.k:
                self.count += 1
                return
            self.hit = True
            if kind == "safetensors":
                raise SafetensorError(
                    "Error while serializing: I/O error: No space left on device (os error 28)"
                )
            if kind == "numpy":
                raise OSError("20001 requested and 16368 written")
            raise OSError(28, "No space left on device", str(filename))

        real_open, real_save, real_np_save = builtins.open, stn.save_file, np.save

        def opened(file, mode="r", *a, **kw):
            if any(c in mode for c in "wax+"):
                fail("open", file)
            return real_open(file, mode, *a, **kw)

        def wrap(kind, real):
            def call(*a, **kw):
                fail(kind, a[0] if a else None)
                return real(*a, **kw)

            return call

        monkeypatch.setattr(builtins, "open", opened)
        monkeypatch.setattr(io, "open", opened)
        monkeypatch.setattr(
            stn, "save_file", lambda t, f, *a, **kw: (fail("safetensors", f), real_save(t, f, *a, **kw))[1]
        )
        monkeypatch.setattr(np, "save", lambda f, *a, **kw: (fail("numpy", f), real_np_save(f, *a, **kw))[1])
        for name in ("replace", "rename", "fsync"):
            monkeypatch.setattr(os, name, wrap("os", getattr(os, name)))


def _real_names(root: Path):
    """Everything under ``root`` but the hidden temporaries a kill would leave."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_full_disk_at_every_write_of_a_save(tmp_path, monkeypatch):
    import paddle

    from bmtrain_cli.config.schema import TrainConfig
    from bmtrain_cli.train.checkpoint.training_state import CheckpointError, save_checkpoint
    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    opt = build_optimizer(model, TrainConfig(learning_rate=0.01), 0.01)
    root = tmp_path / "checkpoints"
    kw = dict(model=model, optimizer=opt, state={"note": "x"}, extra_files={"bmtrain_config.yaml": "a: 1\n"})
    save_checkpoint(root, 1, **kw)
    before = tree_digest(root)
    points = 0
    for k in range(100):
        with monkeypatch.context() as m:
            full = _DiskFull(m, k)
            try:
                save_checkpoint(root, 2, **kw)
            except CheckpointError as exc:
                assert "no space left on " in str(exc) and "step-1" in str(exc), str(exc)
            else:  # a failed fsync of a folder is ignored by design (some filesystems refuse it)
                assert not full.hit or find_latest(root).name == "step-2", f"write {k}: not reported"
        if not full.hit:
            break
        points += 1
        latest = find_latest(root)
        assert latest is not None and latest.name in ("step-1", "step-2"), f"write {k}"
        step2 = root / "step-2"
        if step2.exists():  # renamed into place complete; pointing latest at it may have failed after
            assert (step2 / STATE_FILE).is_file() and (step2 / "optimizer.safetensors").is_file()
            shutil.rmtree(step2)
            (root / "latest").write_text("step-1\n")
        assert tree_digest(root) == before, f"write {k}: {_real_names(root)}"  # no temporary left
    assert points >= 5, points  # weights, optimizer, trainer_state, config, latest


def test_a_full_disk_at_every_write_of_a_token_cache_build(robust_run, tmp_path, monkeypatch):
    from bmtrain_cli.data.cache import open_or_build
    from bmtrain_cli.data.encode import Encoder
    from bmtrain_cli.data.templates import get_template
    from bmtrain_cli.data.tokenizers import load_tokenizer

    _, out, data = robust_run
    tok = load_tokenizer(str(out / "tokenizer"))
    encoder = Encoder(tok, get_template("auto", tok))
    cache = tmp_path / "cache"
    points = 0
    for k in range(50):
        with monkeypatch.context() as m:
            full = _DiskFull(m, k)
            try:
                open_or_build(str(data), encoder, cache_root=str(cache))
            except UserError as exc:
                assert str(exc).startswith("no space left on "), str(exc)
        if not full.hit:
            break
        points += 1
        assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()], f"write {k}"
    assert points >= 3, points  # tokens/mask, offsets, lines, meta
    assert open_or_build(str(data), encoder, cache_root=str(cache)).records == 40  # and it builds after


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["paddle-inference", "hf"])
def test_a_full_disk_at_every_write_of_an_export(robust_run, tmp_path, monkeypatch, fmt):
    from bmtrain_cli.export.pipeline import export_checkpoint

    _, out, _ = robust_run
    ckpt = str(out / "checkpoints" / "step-2")
    dest = tmp_path / "exported"
    points = 0
    for k in range(60):
        with monkeypatch.context() as m:
            full = _DiskFull(m, k, under=tmp_path)
            try:
                export_checkpoint(ckpt, str(dest), fmt=fmt, log=lambda msg: None)
            except UserError as exc:
                assert str(exc).startswith("no space left on "), str(exc)
        if not full.hit:
            break
        points += 1
        left = sorted(p.name for p in tmp_path.iterdir())
        if dest.exists():  # renamed into place complete: only a later fsync of its folder failed
            assert (dest / "export_meta.json").is_file() or any(dest.iterdir()), f"write {k}"
            shutil.rmtree(dest)
        assert not [n for n in left if n.startswith(".")], f"write {k}: {left}"
    assert points >= 3, points


# ----------------------------------------------------------------------------- symlinked and read-only paths


def test_overwrite_refuses_a_symlinked_checkpoints_folder(robust_run, tmp_path):
    tmp, out, data = robust_run
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(out / "checkpoints", elsewhere)
    run = tmp_path / "out"
    run.mkdir()
    (run / "checkpoints").symlink_to(elsewhere)
    before = tree_digest(elsewhere)
    res = CliRunner().invoke(app, ["train", "--config", run_config(tmp_path, run, data, 3), "--overwrite"])
    assert_clean_exit(res, "--overwrite with a symlinked checkpoints folder")
    assert res.exit_code == 2 and "is a symbolic link" in res.output
    assert tree_digest(elsewhere) == before and (run / "checkpoints").is_symlink()


def test_a_read_only_output_dir_is_one_line(robust_run, tmp_path):
    """A read-only file system (a tmpfs remounted read-only; skipped where mount is not allowed)."""
    _, out, data = robust_run
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        shutil.copytree(out, mnt / "run")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for flags in ([], ["--resume"], ["--overwrite"]):
            res = CliRunner().invoke(
                app, ["train", "--config", run_config(tmp_path, mnt / "run", data, 3), *flags]
            )
            assert_clean_exit(res, f"train {flags} on a read-only output_dir")
            assert res.exit_code == 2 and "read-only file system" in res.output.lower(), res.output
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ----------------------------------------------------------------------------- signals during setup


@pytest.mark.slow
def test_sigterm_during_setup_is_a_clean_exit_that_keeps_the_printed_lines(robust_run, tmp_path):
    import signal

    tmp, _, data = robust_run
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop(LOCK_ENV, None)
    cfg = run_config(tmp_path, tmp_path / "out", data, 200)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmtrain_cli", "train", "--config", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the run has printed a line to the pipe
    proc.send_signal(signal.SIGTERM)
    rest = proc.stdout.read()
    assert proc.wait() == 143, first + rest
    assert first.strip() and "Traceback" not in rest and "C++" not in rest and "FatalError" not in rest, rest
    assert "SIGTERM received" in rest
    assert not (tmp_path / "out" / LOCK_FILE).exists()
