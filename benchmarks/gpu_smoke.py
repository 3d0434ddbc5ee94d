"""GPU smoke test of bmtrain-cli with a GPU build of Paddle (paddlepaddle-gpu): one table, in minutes.

What it runs (each training case is `python -m bmtrain_cli train|run` on configs/quickstart.yaml for a
few steps, in its own output directory under --workdir):

* bf16 and fp16 steps, single GPU, ``attention_implementation: auto`` (flash on compute capability >= 8.0)
  and ``sdpa``, ``kernels: auto`` (our CUDA kernels after their launch check) and ``reference``;
* an fp16 run whose first steps overflow (``loss_scale: 1e30``): it must finish every step, with the
  overflowing updates skipped (``loss_scale_overflow`` events in metrics.jsonl, ``skipped_steps`` > 0);
* with 2+ GPUs: tensor parallel 2, pipeline parallel 2, sharding stage 1 and stage 2, in fp16 (the
  loss-scaler wiring of each layout) and bf16;
* in this process: each of our kernels (ops/custom.py on the GPU) against the reference ops, forward and
  backward (ops/launch_check.run_check), in fp32.

Exit status: 0 when every case that ran passed, 1 when one failed, 2 when this machine has no GPU build of
Paddle or no visible GPU (then nothing runs; the reason is printed). Usage:
    python benchmarks/gpu_smoke.py [--steps 6] [--workdir /tmp/bmtrain-gpu-smoke] [--only NAME ...]
Record the printed table in docs/benchmarks.md ("GPU smoke test").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart.yaml"


@dataclass
class Case:
    name: str
    sets: Dict[str, str]
    gpus: int = 1
    expect_overflow: bool = False


@dataclass
class Row:
    name: str
    status: str
    steps: str = ""
    skipped: str = ""
    loss: str = ""
    tokens_per_sec: str = ""
    peak_mib: str = ""
    note: str = ""
    extra: Dict[str, str] = field(default_factory=dict)


def gpu_facts() -> Tuple[Optional[str], int, str]:
    """(why nothing can run, or None; visible GPUs; device name and capability)."""
    try:
        import paddle
    except ImportError:
        return "Paddle is not installed (pip install paddlepaddle-gpu)", 0, ""
    if not paddle.is_compiled_with_cuda():
        return f"Paddle {paddle.__version__} is a CPU build (install paddlepaddle-gpu)", 0, ""
    count = paddle.device.cuda.device_count()
    if count < 1:
        return "Paddle is a GPU build but sees no GPU", 0, ""
    major, minor = paddle.device.cuda.get_device_capability(0)
    return None, count, f"{paddle.device.cuda.get_device_name(0)} (compute capability {major}.{minor})"


def cases(gpus: int, capability_major: int) -> List[Case]:
    half = {"model_config.kernels": "auto"}
    out = [
        Case("bf16 flash auto-kernels", {"train_config.precision": "bf16", **half}),
        Case(
            "bf16 sdpa auto-kernels",
            {"train_config.precision": "bf16", "model_config.attention_implementation": "sdpa", **half},
        ),
        Case(
            "bf16 flash reference-kernels",
            {"train_config.precision": "bf16", "model_config.kernels": "reference"},
        ),
        Case("fp16 flash auto-kernels", {"train_config.precision": "fp16", **half}),
        Case("fp32 sdpa", {"train_config.precision": "fp32"}),
        Case(
            "fp16 overflow (loss_scale 1e30)",
            {"train_config.precision": "fp16", "train_config.loss_scale": "1e30"},
            expect_overflow=True,
        ),
    ]
    if capability_major < 8:  # no bf16 before Ampere: the config check refuses it
        out = [c for c in out if c.sets.get("train_config.precision") != "bf16"]
    if gpus >= 2:
        two = {"train_config.global_batch_size": "128"}
        for precision in ("fp16", "bf16"):
            if precision == "bf16" and capability_major < 8:
                continue
            p = {"train_config.precision": precision}
            out += [
                Case(f"tp2 {precision}", {**p, "parallel_config.tensor_parallel": "2"}, gpus=2),
                Case(f"pp2 {precision}", {**p, "parallel_config.pipeline_parallel": "2"}, gpus=2),
                Case(
                    f"sharding stage1 {precision}",
                    {
                        **p,
                        **two,
                        "parallel_config.sharding_parallel": "2",
                        "parallel_config.sharding_stage": "1",
                    },
                    gpus=2,
                ),
                Case(
                    f"sharding stage2 {precision}",
                    {
                        **p,
                        **two,
                        "parallel_config.sharding_parallel": "2",
                        "parallel_config.sharding_stage": "2",
                    },
                    gpus=2,
                ),
            ]
    return out


def run_case(case: Case, steps: int, workdir: Path, timeout: int) -> Row:
    out_dir = workdir / case.name.replace(" ", "_").replace("(", "").replace(")", "")
    shutil.rmtree(out_dir, ignore_errors=True)
    sets = {
        "train_config.output_dir": str(out_dir),
        "train_config.max_steps": str(steps),
        "train_config.eval_steps": "1000",  # no evaluation or checkpoint inside the few steps
        "train_config.save_steps": "1000",
        "train_config.warmup_steps": "1",
        "train_config.logging_steps": "1",
        "train_config.demo_data": "reverse",
        **case.sets,
    }
    command = "run" if case.gpus > 1 else "train"
    cmd = [sys.executable, "-m", "bmtrain_cli", command, "--config", str(CONFIG)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Row(case.name, "FAIL", note=f"timed out after {timeout} s")
    seconds = time.time() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    summary_file = out_dir / "summary.json"
    if proc.returncode != 0 or not summary_file.is_file():
        return Row(case.name, "FAIL", note=f"exit {proc.returncode}: {tail[0][:120]}")
    s = json.loads(summary_file.read_text())
    row = Row(
        case.name,
        "ok",
        steps=str(s.get("steps")),
        skipped=str(s.get("skipped_steps")),
        loss=f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "-",
        tokens_per_sec=f"{s.get('tokens_per_sec') or 0:.0f}",
        peak_mib=f"{(s.get('peak_memory_bytes') or 0) / 2**20:.0f}",
        note=f"{seconds:.0f} s",
    )
    if int(s.get("steps") or 0) != steps:
        row.status, row.note = "FAIL", f"stopped at step {s.get('steps')} of {steps}"
    if case.expect_overflow:
        events = _events(out_dir, "loss_scale_overflow")
        if not events or not int(s.get("skipped_steps") or 0):
            row.status, row.note = "FAIL", "no overflow was skipped (expected with loss_scale 1e30)"
        else:
            row.note += f"; {len(events)} overflowing updates skipped, run continued"
    return row


def _events(out_dir: Path, name: str) -> List[dict]:
    found = []
    for path in out_dir.rglob("metrics.jsonl"):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == name:
                found.append(record)
    return found


def kernel_rows() -> List[Row]:
    """Our GPU kernels against the reference ops, in this process (fp32, forward + backward)."""
    import paddle

    from bmtrain_cli.ops import OP_NAMES, custom, reference
    from bmtrain_cli.ops.launch_check import launch_checked, run_check

    paddle.set_device("gpu:0")
    try:
        custom._ext()
    except Exception as exc:  # the build itself failed: one row says why
        return [Row("our CUDA kernels", "FAIL", note=f"build: {str(exc).splitlines()[0][:120]}")]
    ours = {n: getattr(custom, n) for n in OP_NAMES}
    kept, failed = launch_checked(ours, {n: getattr(reference, n) for n in OP_NAMES}, run_check)
    rows = [Row(f"kernel {n} vs reference", "ok") for n in kept]
    rows += [Row(f"kernel {n} vs reference", "FAIL", note=why[:120]) for n, why in failed.items()]
    return rows


def print_table(rows: List[Row], header: str) -> None:
    print(header)
    cols = ("case", "status", "steps", "skipped", "final loss", "tokens/s", "peak MiB", "note")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = (r.name, r.status, r.steps, r.skipped, r.loss, r.tokens_per_sec, r.peak_mib, r.note)
        print("| " + " | ".join(cells) + " |")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bmtrain-gpu-smoke"))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument(
        "--only", nargs="*", default=None, help="run only the cases whose name contains one of these"
    )
    args = ap.parse_args(argv)
    why, gpus, device = gpu_facts()
    if why is not None:
        print(f"gpu_smoke: nothing run: {why}", file=sys.stderr)
        return 2
    import paddle

    major = paddle.device.cuda.get_device_capability(0)[0]
    todo = cases(gpus, major)
    if args.only:
        todo = [c for c in todo if any(o in c.name for o in args.only)]
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = kernel_rows() if not args.only else []
    for case in todo:
        rows.append(run_case(case, args.steps, args.workdir, args.timeout))
        print(f"  {rows[-1].name}: {rows[-1].status} {rows[-1].note}", file=sys.stderr, flush=True)
    if gpus < 2:
        rows.append(Row("tp2 / pp2 / sharding stage 1, 2", "skip", note=f"{gpus} GPU visible, 2 needed"))
    print_table(
        rows, f"GPU smoke test: Paddle {paddle.__version__}, {gpus} x {device}, {args.steps} steps per case"
    )
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
