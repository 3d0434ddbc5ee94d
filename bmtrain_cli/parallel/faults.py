"""No silent hangs: rank status files, a watchdog, failure attribution, and the start-up agreement check.

Every rank keeps ``<output_dir>/.ranks/<run id>/rank-N.json`` up to date (pid, host, log file, last
progress time, state). When a rank raises, its excepthook records ``state: failed`` with the error before
the process exits; a rank killed outright leaves a record whose pid is gone. A rank whose own progress
stalls for ``fault_timeout_s`` (a peer hung inside a collective) aborts, naming the ranks that fell behind.
``bmtrain run`` reads the records after the launcher returns and names the rank that failed first and
its log (the launcher itself blames whichever rank it noticed first, often a healthy one).

At start the ranks all-gather a hash of the resolved config and a fingerprint of the data files and stop
with an error naming the ranks that disagree.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import Topology

RUN_ID_ENV = "BMTRAIN_RUN_ID"
LOG_DIR_ENV = "BMTRAIN_LAUNCH_LOG_DIR"
EXIT_CODE = 3  # a rank that stops because a peer failed
COMM_ERROR_MARKERS = ("gloo", "TIMEOUT", "Connection reset", "NCCL", "pair.cc", "Broken pipe")


def run_id() -> str:
    """Identifier shared by the ranks of one launch (bmtrain run sets it; else the launcher's pid)."""
    return os.environ.get(RUN_ID_ENV) or f"launch-{os.getppid()}"


def status_dir(output_dir: str, rid: Optional[str] = None) -> Path:
    return Path(output_dir) / ".ranks" / (rid or run_id())


def worker_log(rank: int) -> str:
    log_dir = os.environ.get(LOG_DIR_ENV)
    if log_dir:
        return str(Path(log_dir) / f"workerlog.{rank}")
    return f"workerlog.{rank} in the launcher's --log_dir"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_comm_error(text: str) -> bool:
    return any(m in text for m in COMM_ERROR_MARKERS)


class Watchdog:
    """Background thread: heartbeat this rank's record and abort when training stops progressing."""

    def __init__(self, directory: Path, timeout_s: float, interval_s: float = 1.0) -> None:
        self.directory = directory
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
        self.world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
        self.progress_time = time.time()
        self.progress_count = 0
        self.state = "running"
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.directory.mkdir(parents=True, exist_ok=True)

    # -- records
    @property
    def path(self) -> Path:
        return self.directory / f"rank-{self.rank}.json"

    def set_rank(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def record(self) -> Dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "log": worker_log(self.rank),
            "time": time.time(),
            "progress_time": self.progress_time,
            "progress": self.progress_count,
            "state": self.state,
            "error": self.error,
        }

    def write(self) -> None:
        with self._lock:
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.record()), encoding="utf-8")
            os.replace(tmp, self.path)

    def mark_progress(self) -> None:
        self.progress_time = time.time()
        self.progress_count += 1

    def mark_failed(self, error: str) -> None:
        self.state, self.error = "failed", error
        self.write()

    def mark_done(self) -> None:
        self.state = "done"
        self.write()
        self._stop.set()

    # -- thread
    def start(self) -> None:
        self.write()
        self._thread = threading.Thread(target=self._loop, name="bmtrain-watchdog", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError:
                pass
            if self.state != "running":
                continue
            failed = first_failure(read_records(self.directory), exclude=self.rank)
            if (
                failed is not None
                and failed.get("state") == "failed"
                and not is_comm_error(failed.get("error") or "")
            ):
                self._abort(describe_failure(failed))
            stalled = time.time() - self.progress_time
            if stalled > self.timeout_s:
                blame = self._laggards()
                if blame or stalled > 10 * self.timeout_s:
                    self._abort(self._stall_message(blame))

    def _laggards(self) -> List[Dict[str, Any]]:
        """Peers that died, stopped heartbeating, or fell behind this rank's progress."""
        now = time.time()
        out = []
        for r in read_records(self.directory):
            if r.get("rank") == self.rank or r.get("state") == "done":
                continue
            dead = not _pid_alive_record(r) or now - float(r.get("time", now)) > self.timeout_s
            if dead or r.get("progress", 0) < self.progress_count:
                out.append(r)
        return out

    def _stall_message(self, blame: List[Dict[str, Any]]) -> str:
        who = (
            ", ".join(f"rank {r['rank']} (log: {r.get('log')})" for r in blame)
            or "all ranks (none is behind)"
        )
        return (
            f"rank {self.rank}: no progress for {self.timeout_s:.0f} s (parallel_config.fault_timeout_s); "
            f"waiting on {who}"
        )

    def _abort(self, message: str) -> None:
        self.state, self.error = "aborted", message
        try:
            self.write()
        except OSError:
            pass
        print(f"error: {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)


def _pid_alive_record(rec: Dict[str, Any]) -> bool:
    if rec.get("host") != socket.gethostname():
        return True  # cannot tell for another host; the heartbeat age decides
    return _pid_alive(int(rec.get("pid", 0)))


def read_records(directory: Path) -> List[Dict[str, Any]]:
    out: List[Dict[str, Any]] = []
    if not directory.is_dir():
        return out
    for f in sorted(directory.glob("rank-*.json")):
        try:
            out.append(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return out


def first_failure(records: List[Dict[str, Any]], exclude: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """The rank to blame: a rank that raised a non-communication error, else a watchdog's timeout report
    (it names the ranks it waited on), else a rank that died without a record of why (killed), else the
    earliest failed rank."""
    candidates = [r for r in records if r.get("rank") != exclude]
    raised = [r for r in candidates if r.get("state") == "failed" and not is_comm_error(r.get("error") or "")]
    if raised:
        return min(raised, key=lambda r: r.get("time", 0))
    aborted = [r for r in candidates if r.get("state") == "aborted"]
    if aborted:  # a watchdog timed out and named the ranks it waited on (they were killed afterwards)
        return min(aborted, key=lambda r: r.get("time", 0))
    died = [r for r in candidates if r.get("state") == "running" and not _pid_alive_record(r)]
    if died:
        earliest = min(died, key=lambda r: r.get("time", 0))
        return dict(earliest, state="died")
    failed = [r for r in candidates if r.get("state") == "failed"]
    if failed:
        return min(failed, key=lambda r: r.get("time", 0))
    return None


def describe_failure(rec: Dict[str, Any]) -> str:
    if rec.get("state") == "died":
        what = f"died (pid {rec.get('pid')} ended without an error: killed or crashed)"
    elif rec.get("state") == "aborted":
        what = f"aborted: {rec.get('error')}"
        return f"rank {rec.get('rank')} {what}"
    else:
        what = f"raised: {rec.get('error')}"
    return f"rank {rec.get('rank')} {what}; see its log {rec.get('log')}"


_WATCHDOG: Optional[Watchdog] = None


def start_watchdog(config: Config) -> Optional[Watchdog]:
    """Start this rank's watchdog and excepthook (once per process)."""
    global _WATCHDOG
    if _WATCHDOG is not None:
        return _WATCHDOG
    try:
        wd = Watchdog(status_dir(config.train.output_dir), config.parallel.fault_timeout_s)
    except OSError:
        return None
    wd.start()
    previous = sys.excepthook

    def hook(exc_type: Any, exc: BaseException, tb: Any) -> None:
        last = traceback.format_exception_only(exc_type, exc)[-1].strip()
        try:
            wd.mark_failed(last[:2000])
        except OSError:
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    atexit.register(lambda: wd.mark_done() if wd.state == "running" else None)
    _WATCHDOG = wd
    return wd


def mark_progress() -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.mark_progress()


def mark_failed(error: str) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.mark_failed(error)


def mark_done() -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.mark_done()


# --------------------------------------------------------------------------- agreement at start


def config_hash(config: Config) -> str:
    return hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def data_fingerprint(config: Config) -> str:
    """Size and head/tail hash of each data file named by the config (cheap; catches different copies)."""
    paths = config.train.data_path
    items = [paths] if isinstance(paths, str) else list(paths or [])
    h = hashlib.sha256()
    for item in items:
        p = Path(item)
        files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            h.update(str(f).encode())
            if f.is_file():
                size = f.stat().st_size
                h.update(str(size).encode())
                with open(f, "rb") as fh:
                    h.update(fh.read(1 << 16))
                    if size > 1 << 16:
                        fh.seek(max(0, size - (1 << 16)))
                        h.update(fh.read())
            else:
                h.update(b"<missing>")
    return h.hexdigest()[:16]


def check_agreement(ctx: Topology, config: Config) -> None:
    """All ranks must run the same config on the same data; raise naming the ranks that differ."""
    if ctx.world_size == 1:
        return
    import paddle.distributed as dist

    mine = {"config": config_hash(config), "data": data_fingerprint(config)}
    everyone: List[Any] = []
    dist.all_gather_object(everyone, mine)
    for key, what in (("config", "config"), ("data", "data files")):
        values = [e[key] for e in everyone]
        if len(set(values)) > 1:
            ref = values[0]
            odd = [str(i) for i, v in enumerate(values) if v != ref]
            raise UserError(
                f"ranks disagree on the {what}: rank(s) {', '.join(odd)} differ from rank 0 "
                f"({key} hashes {values}); every rank must see the same {what}"
            )
