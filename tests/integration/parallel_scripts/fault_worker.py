"""Worker for test_parallel_faults.py: 2 data-parallel ranks all-reduce once per step; at step 3 rank 1
misbehaves as told by --mode (raise | usererror | kill | hang)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel.topology import init_parallel

ap = argparse.ArgumentParser()
ap.add_argument("--mode", required=True)
ap.add_argument("--output_dir", required=True)
ap.add_argument("--timeout", type=float, default=5.0)
a = ap.parse_args()

cfg = Config.model_validate(
    {
        "parallel_config": {"data_parallel": 2, "fault_timeout_s": a.timeout},
        "train_config": {"output_dir": a.output_dir},
    }
)
ctx = init_parallel(cfg)
for step in range(8):
    if ctx.rank == 1 and step == 3:
        if a.mode == "raise":
            raise ValueError("injected failure on rank 1")
        if a.mode == "usererror":  # what a command does with a UserError: message, exit 2, no traceback
            import typer

            from bmtrain_cli.commands.common import user_errors
            from bmtrain_cli.errors import UserError

            @user_errors
            def refuse() -> None:
                raise UserError("injected refusal on rank 1")

            try:
                refuse()
            except typer.Exit as exc:
                sys.exit(exc.exit_code)
        if a.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if a.mode == "hang":
            while True:  # stuck without communicating (e.g. a deadlock in user code)
                time.sleep(0.5)
    ctx.collectives.all_reduce_sum(1.0)
    time.sleep(0.2)
print("rank", ctx.rank, "finished", flush=True)
