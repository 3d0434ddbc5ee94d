"""How a run stops early: a signal (save, then exit 130/143) or non-finite numbers (exit 1 or 2)."""

from __future__ import annotations

import signal
import threading
from typing import Any, Dict, Optional

from bmtrain_cli.errors import UserError


class TrainingStopped(UserError):
    """Training ended early for a reason the user should see (non-finite losses, a signal)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class SignalGuard:
    """SIGINT/SIGTERM ask the loop to save and stop at the end of the current step; a second one
    interrupts at once."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    @property
    def name(self) -> Optional[str]:
        return signal.Signals(self.received).name if self.received is not None else None

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def signal_stop(name: str, step: int, total: int, checkpoint: Any) -> TrainingStopped:
    return TrainingStopped(
        f"{name} received: stopped at step {step}/{total}, checkpoint saved in {checkpoint}; "
        "continue with --resume",
        exit_code=130 if name == "SIGINT" else 143,
    )


def too_many_nonfinite(step: int, count: int, limit: int, checkpoint_dir: Any) -> TrainingStopped:
    return TrainingStopped(
        f"training stopped at step {step}: {count} consecutive steps had a non-finite loss or gradient "
        f"(max_nonfinite_steps {limit}). Lower learning_rate, check the data, or use fp32/bf16; "
        f"the last good checkpoint is kept in {checkpoint_dir}"
    )


def bad_data_stop(message: str, step: int, total: int, checkpoint: Any) -> TrainingStopped:
    """Streaming met a bad record (on_bad_record: error) ahead of this step; ``message`` names the line."""
    return TrainingStopped(
        f"{message}; stopped at step {step}/{total}, checkpoint saved in {checkpoint}. Fix the record, or "
        "set on_bad_record: skip and continue with --resume (it goes to rejected.jsonl)",
        exit_code=2,
    )
