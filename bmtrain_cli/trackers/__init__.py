"""Experiment trackers a training run reports to (``train_config.report_to``).

One small protocol, one module per backend, one registry: the metrics writer (train/monitoring/metrics.py) opens the
configured trackers on the main rank and hands each the same scalars, and config validation asks the
registry which backends' packages are missing. A backend's module is imported only when it is opened, so
a missing optional package never breaks anything else.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple


class Tracker(Protocol):
    """What a backend does with a run's metrics. ``values`` are finite floats keyed by tag (train/loss)."""

    def log_scalars(self, values: Dict[str, float], step: int) -> None: ...

    def log_config(self, config: Dict[str, Any]) -> None:
        """The resolved config (nested sections), as the run's parameters."""
        ...

    def log_summary(self, hparams: Dict[str, Any], metrics: Dict[str, float]) -> None:
        """The run's headline hyper-parameters and final figures, at its end."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # the module under bmtrain_cli.trackers with create(output_dir, resume_step) -> Tracker
    package: str  # the import name of the package it needs
    extra: Optional[str]  # the bmtrain-cli extra that installs it (None: a core dependency)

    @property
    def install(self) -> str:
        return f"pip install 'bmtrain-cli[{self.extra}]'" if self.extra else f"pip install {self.package}"

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None


BACKENDS: Dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("tensorboard", "tensorboard", "tensorboardX", None),
        Backend("visualdl", "visualdl", "visualdl", "visualdl"),
        Backend("wandb", "wandb", "wandb", "wandb"),
        Backend("swanlab", "swanlab", "swanlab", "swanlab"),
        Backend("mlflow", "mlflow", "mlflow", "mlflow"),
    )
}
NONE = "none"
REPORT_TO_NAMES: Tuple[str, ...] = (*BACKENDS, NONE)


def missing(names: Sequence[str]) -> List[Backend]:
    """The configured backends whose package is not importable."""
    return [BACKENDS[n] for n in names if n in BACKENDS and not BACKENDS[n].installed()]


def open_trackers(names: Sequence[str], output_dir: Path, resume_step: Optional[int] = None) -> List[Tracker]:
    """One tracker per configured backend (``none`` and an empty list open none)."""
    out: List[Tracker] = []
    for name in names:
        if name == NONE:
            continue
        module = importlib.import_module(f"{__name__}.{BACKENDS[name].module}")
        out.append(module.create(Path(output_dir), resume_step))
    return out


def flatten(config: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested sections as dotted keys (train_config.learning_rate), for trackers whose parameters are flat;
    lists and other non-scalar values become their text."""
    out: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(value)
    return out


def run_name(output_dir: Path) -> str:
    """The run's name in a tracker's UI: the output directory's name."""
    return Path(output_dir).resolve().name
