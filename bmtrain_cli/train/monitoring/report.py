"""What a training run says: the data it got, the opening line, per-step metrics, the closing summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from bmtrain_cli.train.parts import Parts, StepOutput, TrainState


def data_report(loader: Any, eval_loader: Any, output_dir: Path, truncation: str) -> Dict[str, Any]:
    """What the data came to: usable samples, rejected records (on_bad_record: skip) and over-long samples,
    said at the start and counted in summary.json, so nothing is left out silently."""
    train = loader.stats()
    ev = eval_loader.stats() if eval_loader is not None else None
    rejected = int(train["rejected"]) + (int(ev["rejected"]) if ev else 0)
    overlong = int(train["overlong"])
    parts = [
        train.get("line") or f"data: {train['samples']:,} training samples from {train['records']:,} records"
    ]
    if ev is not None:
        parts.append(f"{ev['samples']:,} eval samples")
    rejected_text = ""
    if rejected:
        where = [f"{train['rejected']} training record(s) in {output_dir / 'rejected.jsonl'}"]
        if ev and ev["rejected"]:
            where.append(f"{ev['rejected']} eval record(s) left out")
        rejected_text = f"{rejected} skipped (on_bad_record: skip): " + "; ".join(where)
        parts.append(rejected_text)
    if overlong:
        parts.append(
            f"{overlong} longer than max_seq_len ({'truncated' if truncation == 'left' else 'dropped'})"
        )
    return {
        "rejected": rejected,
        "overlong": overlong,
        "rejected_text": rejected_text,
        "line": "; ".join(parts),
    }


def final_data_report(parts: Parts) -> Dict[str, Any]:
    """The data report at the end of a run (a streaming loader counts the records it has reached)."""
    d = parts.data
    return data_report(d.loader, d.eval_loader, parts.runtime.output_dir, parts.config.train.truncation)


def opening_lines(parts: Parts, resumed_from: Optional[Path]) -> List[str]:
    """What is trained, how, and on which attention kernel."""
    from bmtrain_cli.models.attention_choice import choose_kernel, training_mask_kind

    t, m, rt = parts.config.train, parts.config.model, parts.runtime
    arch = parts.model.raw.arch
    d = rt.derived
    first = (
        f"training {arch.family} ({parts.model.n_params:,} parameters) for {rt.total_steps} steps: "
        f"global batch {d.global_batch_size} (micro {t.micro_batch_size} x accumulation "
        f"{rt.grad_accum_steps} x data ranks {d.data_ranks}), lr {d.learning_rate:.3g} "
        f"{t.lr_scheduler}, precision {t.precision}, output {rt.output_dir}"
        + (f" (resumed from {resumed_from.name})" if resumed_from is not None else "")
    )
    pipeline = parts.ctx.pp_degree > 1
    kind = training_mask_kind(arch, m.max_seq_len, t.batching == "packed", pipeline)
    precision = parts.optim.precision
    capability = None
    if rt.has_gpu:
        from bmtrain_cli.models.attention import gpu_capability

        capability = gpu_capability()
    kernel, why = choose_kernel(
        kind,
        m.attention_implementation,
        precision.enabled,
        rt.has_gpu,
        seq_len=m.max_seq_len,
        fused_cpu=parts.model.raw.ops.attention is not None,
        capability=capability,
        head_dim=arch.head_dim,
        softcap=arch.attn_logit_softcapping is not None,
    )
    return [first, parts.data.report["line"], f"attention: {kernel} ({why})"]


class StepMeter:
    """Per-step figures for metrics.jsonl/TensorBoard: throughput, MFU against the devices' peak, memory,
    loss scale and gradient compression."""

    def __init__(self, parts: Parts) -> None:
        from bmtrain_cli.models.param_count import count_active_parameters, count_parameters
        from bmtrain_cli.train.monitoring.metrics import flops_per_token, peak_flops

        arch = parts.model.raw.arch
        self.parts = parts
        # a mixture of experts: a token passes only its top-k experts
        n_params = parts.model.n_params - (count_parameters(arch) - count_active_parameters(arch))
        self.flops_per_token = flops_per_token(
            n_params, arch.num_hidden_layers, arch.hidden_size, parts.config.model.max_seq_len
        )
        dtype = parts.optim.precision.dtype
        self.peak = peak_flops(parts.runtime.has_gpu, dtype) * max(1, parts.ctx.world_size)
        self.throughput: List[float] = []  # tokens/s of every step this process ran
        self._start = 0.0

    def start(self) -> None:
        self._start = time.time()

    def stop(self, out: StepOutput) -> float:
        """Seconds the step took; records its tokens/s."""
        elapsed = time.time() - self._start
        self.throughput.append(out.tokens / elapsed if elapsed > 0 else 0.0)
        return elapsed

    def values(self, out: StepOutput) -> Dict[str, Any]:
        tps = self.throughput[-1]
        values: Dict[str, Any] = {
            "loss": out.loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            "tokens_per_sec": tps,
            "mfu": (tps * self.flops_per_token / self.peak) if self.peak else 0.0,
            "memory": self.parts.memory.peak(),
        }
        precision = self.parts.optim.precision
        if precision.loss_scale is not None:
            values["loss_scale"] = precision.loss_scale
        compression = self.parts.ctx.wrapping.compression_stats
        if compression:  # gradient compression: dense / sent bytes so far, and bytes sent
            values["compression_ratio"] = compression["ratio"]
            values["compression_bytes_sent"] = compression["bytes_sent"]
        values.update(out.metrics)  # stage dpo: rewards/*, logps/*
        return values

    def steady_tokens_per_sec(self, state: TrainState) -> float:
        """Mean tokens/s without the first step (kernel set-up, the allocator's first blocks)."""
        steady = self.throughput[1:] if len(self.throughput) > 1 else self.throughput
        return float(np.mean(steady)) if steady else float(state.history.get("tokens_per_sec", 0.0))


def summary(
    parts: Parts,
    state: TrainState,
    meter: StepMeter,
    checkpoint: Path,
    final_eval: Optional[float],
    accuracy: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    """summary.json's content."""
    recent = state.history.get("recent_losses", [])
    data = final_data_report(parts)
    out: Dict[str, Any] = {
        "steps": state.step,
        "final_loss": float(np.mean(recent)) if recent else None,
        "best_eval_loss": state.best_eval_loss,
        "final_eval_loss": final_eval,
        "tokens_per_sec": meter.steady_tokens_per_sec(state),
        "peak_memory_bytes": parts.memory.peak(),
        "peak_memory_source": parts.memory.source,
        "peak_rss_bytes": parts.memory.peak_rss(),
        "wall_time_s": round(time.time() - parts.started, 3),
        "train_time_s": round(state.train_time, 3),
        "tokens_seen": state.tokens_seen,
        "skipped_steps": state.skipped_steps,
        "parameters": parts.model.n_params,
        "rejected_records": data["rejected"],
        "overlong_samples": data["overlong"],
        "checkpoint": str(checkpoint),
        "logs": str(parts.runtime.logs_dir),
    }
    if accuracy is not None:
        out["accuracy_before"] = state.history.get("accuracy_before")
        out["accuracy_after"] = accuracy["accuracy"]
        out["heldout_examples"] = accuracy["examples"]
    return out


def hparams(parts: Parts) -> Dict[str, Any]:
    t, rt = parts.config.train, parts.runtime
    return {
        "learning_rate": rt.derived.learning_rate,
        "global_batch_size": rt.derived.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "lr_scheduler": t.lr_scheduler,
        "warmup_steps": parts.schedule.warmup_steps,
        "weight_decay": t.weight_decay,
        "precision": t.precision,
        "max_seq_len": parts.config.model.max_seq_len,
        "gradient_checkpointing": t.gradient_checkpointing,
        "steps": rt.total_steps,
        "seed": t.seed,
    }


def print_report(parts: Parts, s: Dict[str, Any], method_lines: Sequence[str] = ()) -> None:
    out = parts.console.stream
    loss = f", final loss {s['final_loss']:.4f}" if s["final_loss"] is not None else ""
    print(
        f"done: {s['steps']} steps{loss}; training {s['train_time_s']:.1f} s, total {s['wall_time_s']:.1f} s "
        "with setup, evaluation and checkpoints (summary.json: train_time_s, wall_time_s)",
        file=out,
    )
    if s.get("best_eval_reward") is not None:  # a method whose eval is a reward (GRPO: minus the loss)
        print(f"  best eval reward {s['best_eval_reward']:.4f}", file=out)
    elif s.get("best_eval_loss") is not None:
        print(f"  best eval loss   {s['best_eval_loss']:.4f}", file=out)
    if s.get("accuracy_after") is not None:
        before = s.get("accuracy_before")
        before_txt = f"{100 * before:.1f}%" if before is not None else "?"
        print(f"  held-out accuracy: before {before_txt} -> after {100 * s['accuracy_after']:.1f}%", file=out)
    for line in method_lines:  # the recipe's own (DPO: the held-out preference accuracy)
        print(line, file=out)
    rss = (
        f", process {s['peak_rss_bytes'] / 2**20:.0f} MiB"
        if s["peak_memory_source"] == "host_allocator"
        else ""
    )
    print(
        f"  throughput       {s['tokens_per_sec']:.0f} tokens/s, "
        f"peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB (tensors{rss})",
        file=out,
    )
    data = final_data_report(parts)
    if data["rejected"]:
        print(f"  bad records      {data['rejected_text']}", file=out)
    print(f"  checkpoint       {s['checkpoint']}", file=out)
    print(f"  logs             {s['logs']}  (tensorboard --logdir {s['logs']})", file=out)
    if s.get("plot"):
        print(f"  loss curve       {s['plot']}", file=out)
    print(f"  summary          {parts.runtime.output_dir / 'summary.json'}", file=out)
    out.flush()
