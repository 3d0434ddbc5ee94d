"""The runtime object: everything derived for one training run (paths, devices, batch arithmetic, the
checkpoint to resume from). The config stays frozen; the trainer reads and writes only this.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from bmtrain_cli.checkpoint_layout import (
    CHECKPOINTS_DIR,
    STATE_FILE,
    find_latest,
    latest_under,
    remove_stale_temporaries,
    restore_replaced,
    step_dirs,
)
from bmtrain_cli.config.derived import Derived, derive
from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.machine import gpu_available

# Files and folders a run writes into output_dir (and --overwrite removes; nothing else is touched).
RUN_OUTPUTS = ("checkpoints", "logs", "metrics.jsonl", "summary.json", "loss_curve.png", "rejected.jsonl")


@dataclass
class Runtime:
    config: Config
    derived: Derived
    output_dir: Path
    has_gpu: bool
    resume_from: Optional[Path] = None
    total_steps: int = 0
    data_paths: Dict[str, Any] = field(default_factory=dict)  # train / eval paths actually used

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / CHECKPOINTS_DIR

    @property
    def logs_dir(self) -> Path:
        return self.output_dir / "logs"

    @property
    def grad_accum_steps(self) -> int:
        return self.derived.grad_accum_steps


def resolve_resume(resume: Any, checkpoint_dir: Path) -> Optional[Path]:
    """The checkpoint to continue from: ``true``/``auto`` = the latest one (None when there is none yet,
    so a job can always be started with --resume), a path = that checkpoint (or a checkpoints folder)."""
    if resume is False or resume is None or (isinstance(resume, str) and resume.lower() in ("false", "no")):
        return None
    if resume is True or (isinstance(resume, str) and resume.lower() in ("auto", "true", "yes", "latest")):
        return find_latest(checkpoint_dir)
    path = Path(str(resume))
    if not path.exists():
        raise UserError(f"train_config.resume: {path} does not exist")
    if (path / STATE_FILE).is_file():
        return path
    latest = latest_under(path)
    if latest is None:
        raise UserError(f"train_config.resume: {path} holds no checkpoint (expected a step-N directory)")
    return latest


def prepare_output_dir(config: Config, *, is_main: bool = True) -> Optional[Path]:
    """Refuse an output dir holding another run's checkpoints unless resuming or overwriting, and create
    it. Removes and replaces nothing: :func:`clear_output_dir` does, once every check has passed.
    Returns the checkpoint to resume from."""
    t = config.train
    out = Path(t.output_dir)
    ckpt = out / CHECKPOINTS_DIR
    if is_main:  # a save killed between its two renames: its step is under .old-step-N-<pid> (run-owned)
        restore_replaced(ckpt)
    resume_from = resolve_resume(t.resume, ckpt)
    if resume_from is not None:
        return resume_from
    linked = [name for name in RUN_OUTPUTS if (out / name).is_symlink()] if t.overwrite_output_dir else []
    if linked:  # --overwrite removes these: never through a link to somewhere else
        raise UserError(
            f"{out / linked[0]} is a symbolic link; --overwrite does not remove what it points to: remove "
            "the link yourself or choose another --output_dir"
        )
    existing = step_dirs(ckpt)
    if existing and not t.overwrite_output_dir:
        names = ", ".join(p.name for _, p in existing[-3:])
        raise UserError(
            f"{out} already holds checkpoints of another run ({names}); pass --resume to continue it, "
            "--overwrite to start over in it, or choose another --output_dir"
        )
    if is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create output_dir {out}: {exc.strerror}") from None
    return None


def clear_output_dir(config: Config, *, resuming: bool) -> None:
    """Called once every check has passed (data, tokenizer, model, optimizer, checkpoint), on the main
    rank: remove the half-written saves of a process killed mid-save and, when starting over with
    overwrite, the previous run's outputs (RUN_OUTPUTS; nothing else in output_dir is touched)."""
    out = Path(config.train.output_dir)
    if config.train.overwrite_output_dir and not resuming:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    remove_stale_temporaries(out / CHECKPOINTS_DIR)


def make_runtime(config: Config, has_gpu: Optional[bool] = None, *, is_main: bool = True) -> Runtime:
    resume_from = prepare_output_dir(config, is_main=is_main)
    return Runtime(
        config=config,
        derived=derive(config),
        output_dir=Path(config.train.output_dir),
        has_gpu=gpu_available() if has_gpu is None else has_gpu,
        resume_from=resume_from,
    )
