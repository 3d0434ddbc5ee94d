"""VisualDL records under output_dir/visualdl (``visualdl --logdir output_dir/visualdl``); the config as
a text panel, the headline hyper-parameters in its hyper-parameter panel."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml


class VisualDLTracker:
    def __init__(self, output_dir: Path):
        from visualdl import LogWriter

        self.writer = LogWriter(logdir=str(output_dir / "visualdl"))
        self.tags: List[str] = []

    def log_scalars(self, values: Dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value=value, step=step)
            if tag not in self.tags:
                self.tags.append(tag)

    def log_config(self, config: Dict[str, Any]) -> None:
        self.writer.add_text("config", text_string=yaml.safe_dump(config, sort_keys=False), step=0)

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        # VisualDL's hyper-parameter panel shows scalar tags beside the hyper-parameters
        self.writer.add_hparams(hparams, self.tags or ["train/loss"])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def create(output_dir: Path, resume_step: Optional[int]) -> VisualDLTracker:
    return VisualDLTracker(output_dir)
