"""The one owner of the on-disk checkpoint layout: names, the latest-checkpoint rule, the atomic directory
write (temporary directory -> rename) and the stale temporaries a killed process leaves.

Layout under ``output_dir/checkpoints``::

    step-N/
      config.json + model*.safetensors  Hugging Face layout (models.save_pretrained; load_pretrained reads it)
      tokenizer files                    (when a tokenizer is given)
      optimizer.safetensors              AdamW moments / beta powers / master weights, keyed by parameter name
                                         (the whole state: single process or plain data parallel)
      optimizer-rank-R.safetensors       instead, one per rank when the state is split (tensor/pipeline
                                         parallel, sharding); reused only under the same layout
      trainer_state.json                 step, schedule, loss scaler, RNG states, data position, counters
    latest                               text file naming the newest complete step-N

A LoRA step-N holds the adapters in PEFT layout instead of the weights (lora/adapter_store.py).

Every directory is written under a hidden temporary name, fsynced and renamed into place
(:func:`atomic_directory`): a kill at any moment leaves either the old or the new directory complete, never a
half-written one under a real name. Training (train/checkpoint/training_state.py), export (export/pipeline.py,
export/peft.py) and LoRA (lora/adapter_store.py) all use this module.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from bmtrain_cli.errors import UserError

CHECKPOINTS_DIR = "checkpoints"  # under a run's output_dir
STATE_FILE = "trainer_state.json"  # written last into step-N: marks a complete checkpoint
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_SHARD = "optimizer-rank-{rank}.safetensors"
NATIVE_WEIGHTS_FILE = "weights.safetensors"  # weights of a layer that is not one of our CausalLMs
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_PREFIXES = (".tmp-", ".old-")  # half-written saves and replaced directories


class CheckpointError(UserError):
    """A checkpoint could not be written or read."""


def step_name(step: int) -> str:
    return f"step-{step}"


def is_step_dir_name(name: str) -> bool:
    return STEP_RE.match(name) is not None


def shard_staging_dir(root: Path, step: int) -> Path:
    """Where every rank puts its optimizer part before rank 0 assembles checkpoint step-<step>."""
    return Path(root) / f".tmp-optim-step-{step}"


# ----------------------------------------------------------------------------- discovery


def step_dirs(root: Path) -> List[Tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first."""
    root = Path(root)
    out: List[Tuple[int, Path]] = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        m = STEP_RE.match(child.name)
        if m and child.is_dir() and (child / STATE_FILE).is_file():
            out.append((int(m.group(1)), child))
    return sorted(out)


def find_latest(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names, or the newest complete one when the pointer is missing/stale.
    A pointer naming a step directory that exists but lacks trainer_state.json is refused: a save never
    leaves one (it renames a complete directory into place), so it was damaged, and silently continuing
    from an older step would hide that."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except (OSError, ValueError):
            name = ""
        candidate = root / name
        if name and STEP_RE.match(name) and (candidate / STATE_FILE).is_file():
            return candidate
        if name and STEP_RE.match(name) and candidate.is_dir():
            raise CheckpointError(
                f"{pointer} names {name}, which has no {STATE_FILE}: the checkpoint is damaged; resume from "
                "an earlier one with train_config.resume: PATH/step-N, or start over"
            )
    found = step_dirs(root)
    return found[-1][1] if found else None


def latest_under(path: Path) -> Optional[Path]:
    """The latest complete checkpoint of a checkpoints directory or of a run's output_dir."""
    path = Path(path)
    return find_latest(path) or find_latest(path / CHECKPOINTS_DIR)


def holds_checkpoints(path: Path) -> bool:
    """Whether ``path`` is a checkpoints directory or a run's output_dir (complete or not)."""
    path = Path(path)
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    if not root.is_dir():
        return False
    return (root / LATEST).exists() or any(is_step_dir_name(c.name) for c in root.iterdir())


_OLD_RE = re.compile(r"^\.old-(.+)-\d+$")


def restore_replaced(root: Path) -> None:
    """Put back a directory a save moved aside to replace it (``.old-<name>-<pid>``) when the process was
    killed before the new one took its name: ``<name>`` is then missing, and the moved-aside copy is the
    only complete one. Run before the latest checkpoint is looked up and before temporaries are removed."""
    root = Path(root)
    if not root.is_dir():
        return
    for child in sorted(root.iterdir()):
        m = _OLD_RE.match(child.name)
        if m and child.is_dir() and not (root / m.group(1)).exists():
            os.rename(child, root / m.group(1))
            fsync_dir(root)


def remove_stale_temporaries(root: Path) -> None:
    """Delete half-written saves left by a process killed mid-save (a replaced directory whose
    replacement never took its name is restored first, never deleted)."""
    root = Path(root)
    restore_replaced(root)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(_STALE_PREFIXES) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            elif child.name.startswith(f".{LATEST}.tmp-"):  # write_text_atomic's, killed before its rename
                child.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- durable writes


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for f in files:
            fsync_file(Path(dirpath) / f)
        fsync_dir(Path(dirpath))


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` a hidden temporary beside ``path``, fsync it and rename it to ``path``: ``path`` is
    the old or the new complete file, never a part. A failure (e.g. a full disk) removes the temporary."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        with _suppress_missing():
            tmp.unlink()
    fsync_dir(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def point_latest(root: Path, final: Path) -> None:
    """Make ``latest`` name ``final`` (atomically)."""
    write_text_atomic(Path(root) / LATEST, Path(final).name + "\n")


@contextmanager
def atomic_directory(final: Path, tmp_name: str, *, create: bool = True) -> Iterator[Path]:
    """Yield a temporary directory ``final.parent / tmp_name`` to fill; when the block finishes, fsync it
    and rename it to ``final`` (an existing ``final`` is moved aside first and deleted after), so ``final``
    is always either the old or the new complete directory. When the block raises, the temporary
    directory is removed and ``final`` is untouched. ``create=False`` leaves creating it to the writer."""
    final = Path(final)
    tmp = final.parent / tmp_name
    if tmp.exists():
        shutil.rmtree(tmp)
    if create:
        tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = None
        if final.exists():  # e.g. re-saving a step (the final save right after a resume), --overwrite
            old = final.parent / f".old-{final.name}-{os.getpid()}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- ownership

LOCK_FILE = ".bmtrain.lock"  # in output_dir while a run owns it
LOCK_ENV = "BMTRAIN_OUTPUT_DIR_LOCK"  # the output_dir a parent process (`bmtrain run`) holds for its ranks


def _lock_record(path: Path) -> Dict[str, str]:
    """pid, host and since as the holder wrote them ({} when unreadable)."""
    try:
        return dict(p.split("=", 1) for p in path.read_text(encoding="utf-8").split() if "=" in p)
    except (OSError, ValueError):
        return {}


def _holder(path: Path) -> str:
    info = _lock_record(path)
    if not info.get("pid"):
        return "another process"
    return f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}"


def _pid_dead(path: Path) -> bool:
    """The lock is held, but by a process of this host that no longer exists (a worker it forked still
    holds the open file): stale."""
    import socket

    info = _lock_record(path)
    pid = int(info["pid"]) if info.get("pid", "").isdigit() else 0
    if pid <= 0 or info.get("host") != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _unwritable(out: Path, exc: OSError) -> UserError:
    if exc.errno == errno.ENOSPC:
        return UserError(f"no space left on {out}: free space or choose another --output_dir")
    return UserError(
        f"output_dir {out} is not writable ({exc.strerror}); fix its permissions or choose another --output_dir"
    )


class OutputDirLock:
    """An exclusive hold on a run's output_dir (``fcntl.flock`` on ``output_dir/.bmtrain.lock``, which
    records pid, host and start time for the refusal message). The kernel releases it when the process
    ends, however it ends; a lock file naming a dead process of this host is stale and replaced."""

    def __init__(self, output_dir: Path):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._fd: Optional[int] = None
        self._created_dir = False

    def acquire(self) -> OutputDirLock:
        out = self.output_dir
        try:
            self._created_dir = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
            for _ in range(10):
                if self._try_once():
                    return self
        except OSError as exc:
            self._close()
            raise _unwritable(out, exc) from None
        raise UserError(f"output_dir {out} is in use by another run ({_holder(self.path)})")

    def _try_once(self) -> bool:
        import fcntl
        import socket
        import time

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if _pid_dead(self.path):  # held only by an orphan of a dead run: take a fresh file
                with _suppress_missing():
                    os.unlink(self.path)
                return False
            raise UserError(
                f"output_dir {self.output_dir} is in use by another run ({_holder(self.path)}); wait for it "
                "to end or choose another --output_dir"
            ) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the file was replaced between open and flock: try again on the new one
            os.close(fd)
            return False
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        record = f"pid={os.getpid()} host={socket.gethostname()} since={since}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is None:
            return
        with _suppress_missing():
            os.unlink(self.path)
        self._close()
        out = self.output_dir
        if self._created_dir and not any(p.is_file() or p.is_symlink() for p in out.rglob("*")):
            shutil.rmtree(out, ignore_errors=True)  # created for this run, which wrote no file in it

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextmanager
def _suppress_missing() -> Iterator[None]:
    try:
        yield
    except OSError:  # gone already, not empty, or not ours to remove
        pass


@contextmanager
def own_output_dir(output_dir: Path, *, take: bool = True) -> Iterator[None]:
    """Hold ``output_dir`` for the block (and tell child processes, via LOCK_ENV, that it is held)
    unless a parent process already holds it for this job, or ``take`` is False (a rank other than 0)."""
    key = os.path.realpath(output_dir)
    if not take or os.environ.get(LOCK_ENV) == key:
        yield
        return
    with OutputDirLock(Path(output_dir)):
        previous = os.environ.get(LOCK_ENV)
        os.environ[LOCK_ENV] = key
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(LOCK_ENV, None)
            else:
                os.environ[LOCK_ENV] = previous
