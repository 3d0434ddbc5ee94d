"""`bmtrain plan` and the layout search under context parallel (no Paddle needed): the search proposes
context parallel when a sequence fits no other layout, the longest sequence a layout fits is the estimate's
boundary, and the shipped 32K config's header states what the plan prints for it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.config import load_config
from bmtrain_cli.plan import calibration
from bmtrain_cli.plan.devices import format_bytes, get_device
from bmtrain_cli.plan.estimator import Layout, Workload, estimate, estimate_layout
from bmtrain_cli.plan.search import longest_sequence, search

CP_CONFIG = "configs/qwen2.5-7b-32k-cp-8gpu.yaml"
A100 = get_device("A100-80GB")


@pytest.fixture
def lora_7b(repo_root):
    return Workload.from_config(load_config(str(repo_root / CP_CONFIG)).config)


def test_search_proposes_context_parallel_when_nothing_else_fits(lora_7b) -> None:
    """Rows of 256K tokens: no layout of 8 x 80 GiB without context parallel fits (LoRA on a 7B model, even
    with full recompute), so every proposal splits the rows, and the best one fits rows of that length."""
    w = replace(lora_7b, seq_len=262144)
    one = Layout(dp=8, micro_batch=1, recompute="full")
    assert not estimate_layout(w, one, A100).fits
    found = search(w, A100, gpus=8)
    assert found["best"] is not None and found["fitting"] > 0
    assert all(c.layout.cp > 1 for c in found["ranked"])
    assert found["best"].breakdown["context_parallel_comm"] > 0
    assert longest_sequence(w, found["best"].layout, A100) >= 262144
    assert longest_sequence(w, one, A100) < 262144


@pytest.mark.parametrize("cp", [1, 4, 8])
def test_the_longest_sequence_is_the_estimates_boundary(lora_7b, cp) -> None:
    layout = Layout(dp=8 // cp, cp=cp, micro_batch=1, recompute="full")
    n = longest_sequence(lora_7b, layout, A100)
    assert n % (2 * cp) == 0 and n > 32768
    assert estimate_layout(replace(lora_7b, seq_len=n), layout, A100).fits
    assert not estimate_layout(replace(lora_7b, seq_len=n + 2 * cp), layout, A100).fits


def test_longer_rows_fit_with_a_higher_context_degree(lora_7b) -> None:
    """Each rank of a context group keeps the activations of 1/cp of every row: the longest row a layout
    fits grows with the degree (weights and LoRA states are the same on every rank)."""
    longest = [
        longest_sequence(lora_7b, Layout(dp=8 // cp, cp=cp, micro_batch=1, recompute="none"), A100)
        for cp in (1, 2, 4, 8)
    ]
    assert longest == sorted(longest) and longest[-1] > 6 * longest[0]


def test_shipped_32k_config_states_its_plan(repo_root) -> None:
    """configs/qwen2.5-7b-32k-cp-8gpu.yaml: 32K rows over data parallel 2 x context parallel 4 on 8 GPUs;
    its header's peak, requirement and longest sequence are what `bmtrain plan` computes for it now."""
    cfg = load_config(str(repo_root / CP_CONFIG)).config
    assert (cfg.model.max_seq_len, cfg.parallel.context_parallel, cfg.parallel.world_size) == (32768, 4, 8)
    est = estimate(cfg, "A100-80GB")
    w, layout = Workload.from_config(cfg), Layout.from_config(cfg)
    header = " ".join(line.lstrip("# ") for line in (repo_root / CP_CONFIG).read_text().splitlines()[:8])
    assert est.fits
    assert f"peak of {format_bytes(est.peak)}" in header
    assert f"needs {format_bytes(est.required)}" in header
    assert f"up to {longest_sequence(w, layout, A100)} tokens" in header
    # one GPU per sequence needs recompute at this length: without it the same 8 GPUs do not fit
    assert not estimate_layout(w, replace(layout, dp=8, cp=1), A100).fits


def test_plan_prints_the_longest_sequence(repo_root) -> None:
    res = CliRunner().invoke(
        app,
        ["plan", "--config", str(repo_root / CP_CONFIG), "--gpus", "8", "--device", "A100-80GB", "--search"],
    )
    assert res.exit_code == 0, res.output
    fits = re.search(r"longest sequence this layout fits: (\d+) tokens", res.output)
    assert fits and int(fits.group(1)) > 32768
    assert re.search(r"best layout \(.*fits sequences up to \d+ tokens\)", res.output)
    assert "context_parallel: " in res.output.split("best layout")[1]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.calibration
def test_the_longest_sequence_runs_at_the_devices_budget(tmp_path) -> None:
    """The plan's longest-sequence answer against a run: for a CPU "device" sized so that the answer is
    about 8K tokens, `bmtrain run` (context parallel 2) at that length peaks at the device's memory less the
    plan's reserves, within the calibration tolerance (15%)."""
    data, tok = calibration.prepare(tmp_path)
    name = "h192-l2-s4096-b1-cp2"
    config = calibration.case_config(name, tmp_path, data, tok, steps=2)
    path = tmp_path / "cp2.yaml"

    def load(seq: int):
        config["model_config"]["max_seq_len"] = seq
        path.write_text(yaml.safe_dump(config), encoding="utf-8")
        return load_config(str(path)).config

    sized = estimate(load(8192), "cpu")
    device = get_device("cpu").with_memory(sized.required + (1 << 20))
    cfg = load(4096)
    longest = longest_sequence(Workload.from_config(cfg), Layout.from_config(cfg), device)
    assert 8192 <= longest < 9000
    est = estimate(load(longest), device)
    budget = device.memory_bytes - (est.required - est.peak)  # what the plan leaves for live tensors
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / name / "summary.json").read_text(encoding="utf-8"))
    measured = int(summary["peak_memory_bytes"])
    assert summary["peak_memory_source"] == "host_allocator"
    assert abs(measured / budget - 1) <= 0.15, (longest, measured, budget)


def test_the_ulysses_mode_is_planned_with_the_kernel_of_whole_rows(lora_7b) -> None:
    """Under the ulysses mode (parallel/ulysses.py) the attention is the kernel one process runs (flash on
    an A100), over whole rows of 1/cp of the heads, not the ring: its activations differ from the ring's
    (the ring's grouped copies and fp32 accumulators are gone, the kernel's output is kept beside the
    share's), the note says which, and the traffic is the all-to-alls of q, k, v and the output."""
    from bmtrain_cli.plan.activations import attention_kernel, attention_row

    ring = Layout(dp=2, cp=4, micro_batch=1, recompute="none")
    ulysses = replace(ring, cp_mode="ulysses")
    share = replace(lora_7b, seq_len=8192)  # what the estimator holds of a 32K row per rank
    assert attention_kernel(share, A100, ring) == "ring"
    assert attention_kernel(share, A100, ulysses) == attention_kernel(
        replace(lora_7b, seq_len=32768), A100, Layout(dp=8)
    )
    assert attention_row(share, ulysses) == 32768 and attention_row(share, ring) == 8192
    est = {lay.cp_mode: estimate_layout(lora_7b, lay, A100) for lay in (ring, ulysses)}
    assert est["ulysses"].activations != est["ring"].activations
    assert any("ulysses all-to-all's" in n for n in est["ulysses"].notes)
    from bmtrain_cli.plan.search import _ring_bytes

    a, e = lora_7b.arch, 2
    local = 32768 // 4
    qkvo = (2 * a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim * local
    assert _ring_bytes(lora_7b, ulysses, e) == a.num_hidden_layers * 2 * qkvo * e * 3 / 4


def test_the_ulysses_mode_reads_from_the_config(repo_root) -> None:
    cfg = load_config(str(repo_root / CP_CONFIG)).config
    cfg = cfg.model_copy(
        update={"parallel": cfg.parallel.model_copy(update={"context_parallel_mode": "ulysses"})}
    )
    layout = Layout.from_config(cfg)
    assert layout.cp_mode == "ulysses" and "context 4 (ulysses)" in layout.describe()


def test_the_ring_is_planned_with_the_pair_kernel_it_runs(lora_7b) -> None:
    """parallel/ring_pairs.py pair_kernel: one fused-kernel call per chunk pair on a CPU with our kernels,
    flash attention on a GPU for half-precision unpacked rows, else blocks of Paddle ops, whose 512 x 512
    fp32 temporaries the plan adds."""
    from bmtrain_cli.plan.activations import ring_pair_kernel

    cpu = get_device("cpu")
    ring = Layout(cp=2, micro_batch=1, recompute="none")
    long_rows = replace(lora_7b, seq_len=4096, precision="fp32", kernels="custom")
    blocks = replace(long_rows, kernels="reference")
    assert ring_pair_kernel(long_rows, cpu) and not ring_pair_kernel(blocks, cpu)
    assert ring_pair_kernel(replace(lora_7b, precision="bf16", packed=False), A100)
    assert not ring_pair_kernel(replace(lora_7b, precision="bf16", packed=True), A100)
    assert not ring_pair_kernel(replace(lora_7b, precision="fp32"), A100)
    fused_est, blocks_est = (estimate_layout(w, ring, cpu) for w in (long_rows, blocks))
    assert fused_est.activations < blocks_est.activations


def test_a_sliding_window_keeps_flash_off_the_ring_on_a_gpu(lora_7b) -> None:
    """Paddle's flash_attn (FA2) takes no window: where a layer's window is shorter than the whole rows
    (rank share x cp), the run's rule gives the ring's pairs to the Paddle-op blocks on a GPU, and the plan
    counts their temporaries (activations.py ring_pair_kernel); the fused CPU kernel applies the window itself; a window as long as the
    rows changes nothing."""
    from bmtrain_cli.models.attention_choice import ScoreRule
    from bmtrain_cli.models.attention_choice import ring_pair_kernel as rule
    from bmtrain_cli.plan.activations import ring_pair_kernel

    assert rule("bfloat16", True, False, False, rule=ScoreRule(4096)) == (
        None,
        "a sliding window: Paddle's flash_attn (FA2) takes no window",
    )
    assert rule("float32", False, False, True, rule=ScoreRule(4096))[0] == "cpu_fused"
    share = replace(lora_7b, seq_len=8192, precision="bf16", packed=False)
    windowed = replace(share, arch=replace(share.arch, sliding_window=4096))
    assert ring_pair_kernel(share, A100, 4) and not ring_pair_kernel(windowed, A100, 4)
    assert ring_pair_kernel(replace(share, arch=replace(share.arch, sliding_window=32768)), A100, 4)
    cpu = get_device("cpu")
    assert ring_pair_kernel(replace(windowed, precision="fp32", kernels="custom"), cpu, 4)


def test_soft_capped_scores_keep_flash_off_the_ring_on_a_gpu(lora_7b) -> None:
    """Flash attention caps no scores (Gemma 2's attn_logit_softcapping): on a GPU in bf16 the plan counts
    the blocks of Paddle ops for capped layers, as the run attends them; on a CPU with our kernels the
    fused pair kernel caps them itself, so the plan counts it there as for uncapped layers."""
    from bmtrain_cli.plan.activations import ring_pair_kernel

    gpu_rows = replace(lora_7b, seq_len=8192, precision="bf16", packed=False)
    cpu_rows = replace(lora_7b, seq_len=4096, precision="fp32", kernels="custom")
    for w, device in ((gpu_rows, A100), (cpu_rows, get_device("cpu"))):
        capped = replace(w, arch=replace(w.arch, attn_logit_softcapping=50.0))
        assert ring_pair_kernel(w, device, 2)
        assert ring_pair_kernel(capped, device, 2) == (device is not A100)
