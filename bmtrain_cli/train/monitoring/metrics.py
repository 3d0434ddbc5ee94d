"""Training monitoring: metrics.jsonl, the experiment trackers of ``report_to`` (bmtrain_cli/trackers:
TensorBoard by default), progress output, summary.json, loss plot.

Only the main rank writes. On a terminal a one-line progress bar (loss, lr, tokens/s, ETA) is redrawn;
otherwise a plain line is printed every ``logging_steps``. On resume, metrics.jsonl is cut back to the
checkpoint's step and TensorBoard events after it are purged, so the files read like one run.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, TextIO

from bmtrain_cli.checkpoint_layout import write_atomic, write_text_atomic
from bmtrain_cli.machine import MATMUL_PROBE_N
from bmtrain_cli.methods import PREFERENCE_KEYS
from bmtrain_cli.models.scoring import perplexity
from bmtrain_cli.train.monitoring.expert_load import COLLAPSE_SHARE, TOP_SHARE, collapsed_layers

EVAL_TAGS = ("eval/loss", "eval/ppl")
TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "memory")
TRAIN_TAGS = tuple(f"train/{k}" for k in TRAIN_KEYS)
# also logged as train/<key> when present: data parallel with gradient_compression
COMPRESSION_KEYS = ("compression_ratio", "compression_bytes_sent")
# mixture-of-experts models with output_router_logits: the load-balancing loss (models/moe.py)
MOE_KEYS = ("aux_loss",)
EXPERT_LOAD = (
    "expert_load/"  # and each sparse layer's load, train/expert_load/... (train/monitoring/expert_load.py)
)
# stage grpo, named as TRL logs them (bmtrain_cli/grpo/objective.py), with each reward function's
# rewards/<name>/mean and /std (GRPO_REWARD_SUFFIXES), and the seconds of the rollout and of the update
GRPO_KEYS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "time/rollout",
    "time/update",
)
GRPO_REWARD_SUFFIXES = ("/mean", "/std")


# ----------------------------------------------------------------------------- memory / flops


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc/self/statm), 0 where unavailable."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_allocator() -> Any:
    """Paddle's host (CPU) memory statistics, or None in a build without them."""
    try:
        from paddle.base import core
    except ImportError:  # pragma: no cover - paddle is a precondition of training
        return None
    needed = (
        "host_memory_stat_current_value",
        "host_memory_stat_peak_value",
        "host_memory_stat_reset_peak_value",
    )
    return core if all(hasattr(core, n) for n in needed) else None


class MemoryMeter:
    """peak_memory_bytes as the memory planner predicts it: the peak bytes of live Paddle tensors on the
    training device since the model started to be built. On GPU ``max_memory_allocated``; on CPU the same
    figure from Paddle's host allocator statistics (peak minus what was allocated at the start). The
    process's resident set (``peak_rss``) is reported beside it: it adds the Python heap and the pages
    of shared libraries touched while training, which depend on the page cache rather than on the
    model (docs/plan.md, "What is measured")."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.rss_baseline = current_rss_bytes()
        self._host = None if on_gpu else _host_allocator()
        self._host_baseline = 0
        if self._host is not None:
            self._host_baseline = int(self._host.host_memory_stat_current_value("Allocated", 0))
            self._host.host_memory_stat_reset_peak_value("Allocated", 0)

    def training_starts(self) -> None:
        """Call once the model is built and its weights (and a resumed checkpoint) are loaded: on a GPU the
        allocator's peak is reset, so that the reported peak is the training peak (the weights, gradients,
        optimizer state and activations the planner predicts), not the transient copies of loading. The
        CPU figure keeps its measured meaning (peak since the model started to be built)."""
        if self.on_gpu:
            import paddle

            paddle.device.cuda.reset_max_memory_allocated()

    @property
    def source(self) -> str:
        if self.on_gpu:
            return "gpu_allocator"
        return "host_allocator" if self._host is not None else "rss"

    def peak(self) -> int:
        if self.on_gpu:
            import paddle

            return int(paddle.device.cuda.max_memory_allocated())
        if self._host is not None:
            return max(0, int(self._host.host_memory_stat_peak_value("Allocated", 0)) - self._host_baseline)
        return self.peak_rss()

    def peak_rss(self) -> int:
        """Peak resident set of the process minus the resident set when the meter was made."""
        return max(0, peak_rss_bytes() - self.rss_baseline)


# Dense peak throughput (FLOP/s) of common accelerators by precision, for MFU.
GPU_PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "A800": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "L40": {"bfloat16": 181e12, "float16": 181e12, "float32": 90e12},
    "V100": {"bfloat16": 0.0, "float16": 125e12, "float32": 15.7e12},
    "4090": {"bfloat16": 165e12, "float16": 165e12, "float32": 82e12},
}


def peak_flops(on_gpu: bool, dtype: str = "float32", threads: Optional[int] = None) -> float:
    """Peak FLOP/s of the device this process trains on, for MFU: a GPU's dense peak from the table, the
    CPU's measured fp32 matmul throughput (:func:`measured_matmul_flops`). 0 when unknown (MFU is then 0).
    ``threads`` is accepted for callers that pass it; the CPU measurement uses Paddle's own threads."""
    if on_gpu:
        try:
            import paddle

            name = paddle.device.cuda.get_device_name()
        except (RuntimeError, ValueError, AttributeError):
            return 0.0
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name:
                return table.get(dtype, 0.0)
        return 0.0
    return measured_matmul_flops()


_measured: Dict[int, float] = {}


def measured_matmul_flops(n: int = MATMUL_PROBE_N, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n fp32 matmul on the CPU with Paddle (best of ``repeats``, after one warm-up;
    measured once per process, about 0.5 s on 2 cores). A CPU's "peak" in MFU is this measured figure: the
    clock x FMA-width bound is not reachable by any BLAS and depends on which code path the BLAS takes
    (docs/benchmarks.md, "MKL on AMD CPUs")."""
    if n in _measured:
        return _measured[n]
    import paddle

    with paddle.no_grad():
        a = paddle.randn([n, n], dtype="float32").cpu()
        b = paddle.randn([n, n], dtype="float32").cpu()
        float(paddle.matmul(a, b)[0, 0])
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(paddle.matmul(a, b)[0, 0])
            best = min(best, time.perf_counter() - t0)
    _measured[n] = 2.0 * n**3 / best
    return _measured[n]


def flops_per_token(n_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls plus 12 L h s for attention scores (forward+backward)."""
    return 6.0 * n_params + 12.0 * num_layers * hidden * seq_len


# ----------------------------------------------------------------------------- writer


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class MetricsWriter:
    """Writes metrics.jsonl, the trackers' records and progress output for the main rank."""

    def __init__(
        self,
        output_dir: Path,
        *,
        total_steps: int,
        logging_steps: int = 10,
        enabled: bool = True,
        resume_step: Optional[int] = None,
        stream: Optional[TextIO] = None,
        tty: Optional[bool] = None,
        report_to: Sequence[str] = ("tensorboard",),
    ):
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.logging_steps = max(1, logging_steps)
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.metrics_path = self.output_dir / "metrics.jsonl"
        self.trackers: List[Any] = []
        self._bar_open = False
        self._collapsed: Set[str] = set()  # the sparse layers already warned of (router collapse)
        # the ETA is measured from the first step this process logs: the first step (kernel set-up, the
        # allocator's first blocks) is several times slower than the rest and would inflate it
        self._eta_origin: Optional[tuple] = None
        if not enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.metrics_path, resume_step)
        elif self.metrics_path.exists():
            self.metrics_path.unlink()
        self._jsonl = open(self.metrics_path, "a", encoding="utf-8")
        from bmtrain_cli.trackers import open_trackers

        self.trackers = open_trackers(report_to, self.output_dir, resume_step)

    # -- records
    def _write_record(self, record: Dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()

    def log_train(self, step: int, values: Dict[str, Any]) -> None:
        """One optimizer step's metrics; ``step`` counts from 1."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        self._write_record(record)
        if self._is_logging_step(step):
            per_reward = tuple(
                k
                for k in values
                if k.startswith("rewards/") and k.endswith(GRPO_REWARD_SUFFIXES) or k.startswith(EXPERT_LOAD)
            )
            keys = TRAIN_KEYS + COMPRESSION_KEYS + MOE_KEYS + PREFERENCE_KEYS + GRPO_KEYS + per_reward
            keys += ("loss_scale",)
            self._scalars({f"train/{k}": values.get(k) for k in keys}, step)
        self._progress(step, values)
        self._warn_collapse(step, values)

    def _warn_collapse(self, step: int, values: Dict[str, Any]) -> None:
        """A warning (console and metrics.jsonl), once per layer and run, when a router sent more than
        COLLAPSE_SHARE of a sparse layer's tokens to one expert this step."""
        for layer in collapsed_layers(values):
            if layer in self._collapsed:
                continue
            self._collapsed.add(layer)
            share = values[f"{TOP_SHARE}{layer}"]
            self.log_event(step, "router_collapse", layer=layer, top_share=share)
            self.message(
                f"warning: step {step}: the router of {layer.replace('_', ' ')} sent {100 * share:.1f}% of "
                f"its tokens to one expert (over {100 * COLLAPSE_SHARE:.0f}%: a collapsed router; raise "
                "router_aux_loss_coef or lower the learning rate)"
            )

    def _scalars(self, values: Dict[str, Any], step: int) -> None:
        """The finite numbers of ``values`` to every tracker."""
        clean = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if clean:
            for tracker in self.trackers:
                tracker.log_scalars(clean, step)

    def _is_logging_step(self, step: int) -> bool:
        """Tracker scalars and plain progress lines: every logging_steps, the first and the last step
        (metrics.jsonl gets every step: it is one small line and resume checks compare step by step)."""
        return step % self.logging_steps == 0 or step == 1 or step == self.total_steps

    def log_eval(
        self, step: int, loss: float, extra: Optional[Dict[str, Any]] = None, *, nll: bool = True
    ) -> None:
        """An eval record; ``nll``: the loss is a mean token negative log-likelihood, so its exp is a
        perplexity (not for the preference losses of stage dpo: DPO, IPO, SimPO, ORPO)."""
        if not self.enabled:
            return
        ppl = perplexity(loss) if nll else None
        record = {"step": step, "eval_loss": _clean(loss), **(extra or {})}
        if ppl is not None:
            record["eval_ppl"] = _clean(ppl)
        self._write_record(record)
        scalars = {"eval/loss": loss, **{f"eval/{k}": v for k, v in (extra or {}).items()}}
        if ppl is not None:
            scalars["eval/ppl"] = ppl
        self._scalars(scalars, step)
        # the method's headline figures (GRPO's reward, DPO's accuracies) beside the loss; per-function
        # or per-part figures (names with a "/") only in metrics.jsonl and TensorBoard
        headline = "".join(
            f" {k} {v:.4f}" for k, v in (extra or {}).items() if "/" not in k and isinstance(v, (int, float))
        )
        self.message(
            f"eval step {step}: loss {loss:.4f}" + (f" ppl {ppl:.2f}" if ppl is not None else "") + headline
        )

    def log_event(self, step: int, event: str, **fields: Any) -> None:
        """A non-metric event (skipped step, checkpoint saved) in metrics.jsonl."""
        if self.enabled:
            self._write_record({"step": step, "event": event, **{k: _clean(v) for k, v in fields.items()}})

    def add_hparams(self, hparams: Dict[str, Any], metrics: Dict[str, Optional[float]]) -> None:
        """The headline hyper-parameters and final figures, to each tracker at the end of a run."""
        if self.enabled:
            clean = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in hparams.items()}
            finals = {k: float(v) for k, v in metrics.items() if v is not None}
            for tracker in self.trackers:
                tracker.log_summary(clean, finals)

    def log_config(self, config: Dict[str, Any]) -> None:
        """The resolved config, as each tracker's run parameters."""
        if self.enabled:
            for tracker in self.trackers:
                tracker.log_config(config)

    # -- console
    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _progress(self, step: int, values: Dict[str, Any]) -> None:
        now = time.time()
        if self._eta_origin is None:
            self._eta_origin = (now, step)
        t0, s0 = self._eta_origin
        eta = (now - t0) / (step - s0) * (self.total_steps - step) if step > s0 else float("nan")
        loss = values.get("loss")
        loss_txt = f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else str(loss)
        body = (
            f"step {step}/{self.total_steps} loss {loss_txt} lr {values.get('lr', 0):.3g} "
            f"tok/s {values.get('tokens_per_sec', 0):.0f} ETA {_fmt_eta(eta)}"
        )
        if self.tty:
            width = 24
            filled = int(width * step / max(1, self.total_steps))
            self.stream.write("\r[" + "#" * filled + "-" * (width - filled) + "] " + body + "   ")
            self.stream.flush()
            self._bar_open = True
        elif self._is_logging_step(step):
            self.stream.write(body + "\n")
            self.stream.flush()

    def flush(self) -> None:
        if self.enabled:
            self._jsonl.flush()
            for tracker in self.trackers:
                tracker.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar_open:
            self.stream.write("\n")
            self._bar_open = False
        self._jsonl.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        self.enabled = False


def _clean(v: Any) -> Any:
    """JSON has no inf/nan: write them as strings so the file stays valid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (a killed run may have logged steps past its checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) <= last_step:
            kept.append(line)
    write_text_atomic(path, "".join(x + "\n" for x in kept))


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    out = []
    if Path(path).exists():
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def write_summary(output_dir: Path, summary: Dict[str, Any]) -> Path:
    path = Path(output_dir) / "summary.json"
    write_text_atomic(path, json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")
    return path


def plot_loss_curve(metrics_path: Path, png_path: Path) -> Optional[Path]:
    """Train (and eval) loss against step as a PNG (matplotlib Agg), titled with the run's directory, on a
    log-scale y axis when every loss is positive; None when there is nothing to plot."""
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], label="train loss", linewidth=1)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    values = [v for _, v in train + evals]
    if values and min(values) > 0:  # a loss falls by orders of magnitude; a linear axis flattens the end
        ax.set_yscale("log")
        ax.set_ylabel("loss (log scale)")
    else:
        ax.set_ylabel("loss")
    ax.set_title(f"loss per step: {Path(png_path).resolve().parent.name}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    try:
        write_atomic(Path(png_path), lambda tmp: fig.savefig(tmp, format="png"))
    finally:
        plt.close(fig)
    return Path(png_path)
