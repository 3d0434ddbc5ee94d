"""Weights & Biases: offline by default (WANDB_MODE=offline unless set), the run under
output_dir/wandb (upload later with ``wandb sync output_dir/wandb/offline-run-*``); the config as the
run's config. WANDB_PROJECT names the project (default bmtrain)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from bmtrain_cli.trackers import run_name


class WandbTracker:
    def __init__(self, output_dir: Path):
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "bmtrain"),
            name=run_name(output_dir),
            dir=str(output_dir.resolve()),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]  # W&B checks the value
            # the progress bar stays ours: W&B does not capture the console
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def log_config(self, config: Dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        self.run.summary.update(metrics)

    def flush(self) -> None:
        """W&B writes its records in the background; nothing to force."""

    def close(self) -> None:
        self.run.finish()


def create(output_dir: Path, resume_step: Optional[int]) -> WandbTracker:
    return WandbTracker(output_dir)
