"""The CPU estimate against real `bmtrain train` runs: within 15% of summary.json's peak_memory_bytes on
26 configurations (sizes, sequence lengths up to 4096, micro batches, recompute off / attention / full /
partial, batching max_length / longest / packed, accumulation, optimizer offload, LoRA, reference
kernels, LLaMA, Qwen2 and the Qwen3.5 hybrid with its linear-attention layers, a qwen3_moe mixture of experts (grouped GEMM, LoRA, reference), a stage grpo run (alone and under context parallel 2), context
parallel 2 and 4 (ring) and 2 (ulysses) and expert parallel 2 through `bmtrain run`: rank 0's peak). The estimate is the one `bmtrain plan --device cpu`
prints for the case after its run; the runs use `kernels: auto` as users run it: on a CPU each new model
shape times the ops and records the choice (ops/choice.py; the test session's own record,
tests/conftest.py), and the plan counts that recorded choice (docs/plan.md)."""

from __future__ import annotations

import pytest

from bmtrain_cli.plan import calibration


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.calibration
def test_cpu_estimate_within_15_percent_of_bmtrain_train(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("BMTRAIN_KERNEL_CHOICE", raising=False)  # as users run it (tests/conftest.py pins it)
    rows = calibration.run(tmp_path)
    assert len(rows) == len(calibration.CASES) >= 6
    report = "\n".join(
        f"{r['case']}: predicted {r['predicted']} measured {r['measured']} ({r['error']:+.1%}), "
        f"process RSS {r['process_rss']}"
        for r in rows
    )
    print(report)  # the table behind docs/plan.md (pytest -s)
    for r in rows:
        assert r["source"] == "host_allocator", report  # Paddle's allocator peak, not an RSS fallback
        assert r["measured"] > 20 << 20, report  # a real peak, not an empty measurement
        # the tensors are part of the process: the allocator's peak cannot exceed the RSS growth by much
        assert r["measured"] <= 1.05 * r["process_rss"], report
        assert abs(r["error"]) <= 0.15, report
    # the cases really differ: the estimate follows them rather than one constant
    measured = sorted(r["measured"] for r in rows)
    assert measured[-1] > 4 * measured[0], report
