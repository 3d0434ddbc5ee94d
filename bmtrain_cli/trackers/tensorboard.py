"""TensorBoard event files under output_dir/logs (tensorboardX); the config as a text panel."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import yaml


class TensorBoardTracker:
    def __init__(self, output_dir: Path, resume_step: Optional[int]):
        from tensorboardX import SummaryWriter

        kwargs: Dict[str, Any] = {"flush_secs": 10}
        if resume_step is not None:  # events a killed run wrote past its checkpoint are dropped
            kwargs["purge_step"] = resume_step + 1
        self.writer = SummaryWriter(logdir=str(output_dir / "logs"), **kwargs)

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def log_config(self, config: Dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "```", 0)

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        self.writer.add_hparams(hparams, {f"hparam/{k}": v for k, v in metrics.items()}, name="hparams")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def create(output_dir: Path, resume_step: Optional[int]) -> TensorBoardTracker:
    return TensorBoardTracker(output_dir, resume_step)
