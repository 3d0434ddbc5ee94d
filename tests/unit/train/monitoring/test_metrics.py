"""metrics.jsonl, TensorBoard tags, resume truncation, summary and plot."""

from __future__ import annotations

import io
import json

import pytest

from bmtrain_cli.train.monitoring.metrics import (
    EVAL_TAGS,
    TRAIN_TAGS,
    MetricsWriter,
    plot_loss_curve,
    read_metrics,
    write_summary,
)


def _vals(step):
    return {
        "loss": 2.0 / step,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_sec": 100.0,
        "mfu": 0.01,
        "memory": 1234,
    }


def test_jsonl_tensorboard_and_plot(tmp_path, monkeypatch):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=4, logging_steps=2, stream=out, tty=False)
    for step in range(1, 5):
        w.log_train(step, _vals(step))
    w.log_eval(4, 0.7)
    w.log_config({"train_config": {"learning_rate": 1e-3, "precision": "fp32"}})
    w.add_hparams({"learning_rate": 1e-3, "precision": "fp32"}, {"final_loss": 0.5})
    w.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3, 4]
    assert recs[-1]["eval_loss"] == 0.7
    text = out.getvalue()
    assert "step 2/4" in text and "step 3/4" not in text and "tok/s" in text and "ETA" in text

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "logs"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(TRAIN_TAGS) | set(EVAL_TAGS) <= tags
    # TensorBoard gets the logging steps (every 2nd), the first and the last step; metrics.jsonl every step
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 4]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([2.0, 1.0, 0.5])
    assert "config/text_summary" in acc.Tags()["tensors"]  # the config as a text panel
    assert (tmp_path / "logs" / "hparams").is_dir()

    import matplotlib.pyplot as plt

    made = []
    monkeypatch.setattr(plt, "close", lambda fig: made.append(fig))  # keep the figure to look at it
    png = plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    (ax,) = made[0].axes
    assert ax.get_yscale() == "log" and ax.get_title() == f"loss per step: {tmp_path.name}"
    plt.close("all")


def test_eval_of_a_non_nll_loss_has_no_perplexity(tmp_path):
    """stage dpo's eval loss (DPO, IPO, SimPO, ORPO) is no token NLL: no ppl line, record or scalar."""
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=2, logging_steps=1, stream=out, tty=False)
    w.log_eval(2, 0.69, {"rewards/accuracies": 0.9}, nll=False)
    w.close()
    (rec,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert "eval_ppl" not in rec and rec["rewards/accuracies"] == 0.9
    assert "eval step 2: loss 0.6900" in out.getvalue() and "ppl" not in out.getvalue()


def test_eval_line_shows_the_methods_headline_figures_not_per_part_ones(tmp_path):
    """GRPO's eval: the held-out reward beside the loss; the per-function rewards (names with a "/") only in
    metrics.jsonl."""
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=2, logging_steps=1, stream=out, tty=False)
    w.log_eval(2, -0.75, {"reward": 0.75, "rewards/accuracy/mean": 0.75}, nll=False)
    w.close()
    (line,) = [x for x in out.getvalue().splitlines() if x.startswith("eval step")]
    assert line == "eval step 2: loss -0.7500 reward 0.7500"
    (rec,) = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval_loss" in r]
    assert rec["rewards/accuracy/mean"] == 0.75


def test_resume_truncates_later_records(tmp_path):
    w = MetricsWriter(tmp_path, total_steps=10, stream=io.StringIO(), tty=False, report_to=())
    for step in range(1, 8):
        w.log_train(step, _vals(step))
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "loss"')  # a line cut by kill -9
    w = MetricsWriter(tmp_path, total_steps=10, stream=io.StringIO(), tty=False, report_to=(), resume_step=5)
    w.log_train(6, _vals(6))
    w.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_tty_progress_bar_and_summary(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=2, stream=out, tty=True, report_to=())
    w.log_train(1, _vals(1))
    w.message("hello")
    w.close()
    assert "\r[" in out.getvalue() and "hello\n" in out.getvalue()
    p = write_summary(tmp_path, {"steps": 2, "final_loss": float("nan")})
    assert json.loads(p.read_text())["final_loss"] == "nan"


def test_memory_meter_on_cpu_is_the_allocators_peak_since_it_was_made() -> None:
    paddle = pytest.importorskip("paddle")
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter

    paddle.set_device("cpu")
    before = paddle.ones([1024, 256])  # 1 MiB alive before the meter: not counted
    meter = MemoryMeter(on_gpu=False)
    assert meter.source == "host_allocator"
    a = paddle.ones([1024, 1024])  # 4 MiB
    b = paddle.ones([1024, 2048])  # 8 MiB: peak 12 MiB
    del a, b
    c = paddle.ones([1024, 512])  # 2 MiB after the peak
    peak = meter.peak()
    assert 12 << 20 <= peak < (12 << 20) + (256 << 10), peak
    assert meter.peak_rss() >= 0
    del before, c


def test_eta_is_measured_from_the_first_logged_step(tmp_path, monkeypatch):
    """A slow first step (set-up) does not inflate the ETA: 10 s of set-up, then 1 s per step."""
    from bmtrain_cli.train.monitoring import metrics as m

    clock = [100.0]
    monkeypatch.setattr(m.time, "time", lambda: clock[0])
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=20, stream=out, tty=False, report_to=(), logging_steps=5)
    clock[0] += 10.0  # the first step
    w.log_train(1, _vals(1))
    clock[0] += 9.0  # steps 2..10 at 1 s each
    w.log_train(10, _vals(10))
    w.close()
    lines = [x for x in out.getvalue().splitlines() if x.startswith("step ")]
    assert lines[0].endswith("ETA ?") and lines[-1].endswith("ETA 10s"), lines


def test_cpu_peak_is_a_measured_matmul_throughput() -> None:
    """MFU's CPU peak is measured (once per process): n^3 matmul FLOPs over the best time, cached."""
    from bmtrain_cli.train.monitoring import metrics

    metrics._measured.pop(256, None)
    flops = metrics.measured_matmul_flops(n=256, repeats=2)
    assert 1e8 < flops < 1e14  # a real throughput, not a clock-based bound of 0 or inf
    assert metrics.measured_matmul_flops(n=256) == flops  # cached
    assert metrics.peak_flops(on_gpu=False) == metrics.measured_matmul_flops()


def test_gpu_peak_is_reset_when_training_starts(monkeypatch):
    """On a GPU the allocator's peak is reset after loading: the reported peak is the training peak."""
    import paddle

    from bmtrain_cli.train.monitoring.metrics import MemoryMeter

    calls = []
    monkeypatch.setattr(paddle.device.cuda, "reset_max_memory_allocated", lambda *a: calls.append("reset"))
    monkeypatch.setattr(paddle.device.cuda, "max_memory_allocated", lambda *a: 0 if calls else 10**9)
    meter = MemoryMeter(on_gpu=True)
    assert meter.peak() == 10**9  # loading's transient copies
    meter.training_starts()
    assert calls == ["reset"] and meter.peak() == 0
    cpu = MemoryMeter(on_gpu=False)
    cpu.training_starts()
    assert calls == ["reset"]  # the CPU figure keeps its meaning
