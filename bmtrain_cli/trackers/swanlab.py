"""SwanLab: offline by default (SWANLAB_MODE, default offline: the run is written under
output_dir/swanlog and uploaded later with ``swanlab sync``; ``local`` also serves it with
``swanlab watch`` and needs swanboard); the config as the run's config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from bmtrain_cli.trackers import run_name


class SwanLabTracker:
    def __init__(self, output_dir: Path):
        import swanlab

        self.swanlab = swanlab
        self.run = swanlab.init(
            project=os.environ.get("SWANLAB_PROJECT", "bmtrain"),
            name=run_name(output_dir),
            log_dir=str((output_dir / "swanlog").resolve()),
            mode=os.environ.get("SWANLAB_MODE", "offline"),
            reinit=True,
        )

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_config(self, config: Dict[str, Any]) -> None:
        self.run.config.update(config)

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        """SwanLab shows the config and each scalar's last value already; nothing more to write."""

    def flush(self) -> None:
        """SwanLab writes its records in the background; nothing to force."""

    def close(self) -> None:
        self.run.finish()


def create(output_dir: Path, resume_step: Optional[int]) -> SwanLabTracker:
    return SwanLabTracker(output_dir)
