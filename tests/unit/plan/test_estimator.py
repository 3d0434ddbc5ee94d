"""The memory estimator, the layout search and `bmtrain plan` (no Paddle needed)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.config import load_config
from bmtrain_cli.errors import UserError
from bmtrain_cli.models.param_count import count_parameters
from bmtrain_cli.plan.devices import GiB, get_device, parse_bytes
from bmtrain_cli.plan.estimator import (
    Layout,
    Workload,
    estimate,
    estimate_layout,
    memory_warning,
    training_estimate,
)
from bmtrain_cli.plan.search import search, step_time, yaml_block

SEVEN_B = "configs/llama2-7b-sft-8gpu.yaml"


@pytest.fixture
def seven_b(repo_root):
    return load_config(str(repo_root / SEVEN_B)).config


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("24g") == 24 * GiB
    with pytest.raises(UserError):
        parse_bytes("lots")
    assert parse_bytes("512B") == 512
    with pytest.raises(UserError, match="has no unit: write 80GiB"):
        parse_bytes("80")  # `--gpu_memory 80` is not 80 bytes
    assert get_device("h100").memory_bytes == 80 * GiB
    assert get_device("A100-80GB", "40GiB").memory_bytes == 40 * GiB
    with pytest.raises(UserError, match="presets"):
        get_device("TPU")


def test_seven_b_state_accounting(seven_b) -> None:
    """bf16 O2: 2 (weights) + 2 (grads) + 4 (master) + 8 (Adam) bytes per parameter, split by tp 2."""
    n = count_parameters(Workload.from_config(seven_b).arch)
    est = estimate(seven_b, "A100-80GB")
    assert est.layout == Layout(dp=4, tp=2, micro_batch=2, recompute="full")
    assert abs(est.parameters - 2 * n / 2) / (n) < 0.01
    assert abs(est.gradients - 2 * n / 2) / n < 0.01
    assert abs(est.master_weights - 4 * n / 2) / n < 0.01
    assert abs(est.optimizer_states - 8 * n / 2) / n < 0.01
    assert est.fits
    # recompute full keeps one hidden-size tensor per layer: far less than without
    rec = est.activations_by_recompute
    assert rec["full"] * 5 < rec["none"]
    d = est.to_dict()
    assert d["fits"] and d["device"] == "A100-80GB" and d["peak"] == est.peak


def test_layout_changes_move_memory_the_right_way(seven_b) -> None:
    w = Workload.from_config(seven_b)
    dev = get_device("A100-80GB")
    base = estimate_layout(w, Layout(dp=8, micro_batch=1), dev)
    assert not base.fits  # full 7B AdamW state (16 bytes/param) on one 80 GB device
    z1 = estimate_layout(w, Layout(sharding=8, stage=1, micro_batch=1), dev)
    z2 = estimate_layout(w, Layout(sharding=8, stage=2, micro_batch=1), dev)
    z3 = estimate_layout(w, Layout(sharding=8, stage=3, micro_batch=1), dev)
    assert z1.optimizer_states * 8 == pytest.approx(base.optimizer_states, rel=1e-6)
    assert z3.peak < z2.peak < z1.peak < base.peak
    assert z2.gradients < z1.gradients and z3.parameters < z2.parameters
    off = estimate_layout(w, Layout(dp=1, micro_batch=1, offload_optimizer=True), dev)
    assert (
        off.optimizer_states == 0 and off.master_weights == 0 and off.host_bytes > 70 * GiB
    )  # 12 bytes/param on the host
    pp = estimate_layout(w, Layout(dp=2, pp=4, micro_batch=1), dev)
    assert pp.parameters < base.parameters / 3
    more_batch = estimate_layout(w, Layout(sharding=8, stage=1, micro_batch=4), dev)
    assert more_batch.activations > 3.5 * z1.activations


def test_lora_needs_a_fraction_of_full(seven_b) -> None:
    w = Workload.from_config(seven_b)
    dev = get_device("A100-80GB")
    lay = Layout(micro_batch=1, recompute="full")
    full = estimate_layout(w, lay, dev)
    lora = estimate_layout(replace(w, finetuning="lora", lora_rank=8), lay, dev)
    assert lora.trainable_parameters < full.trainable_parameters / 100
    assert lora.optimizer_states < full.optimizer_states / 100
    assert lora.parameters >= full.parameters  # frozen base weights stay
    assert lora.fits and not full.fits


def test_seven_b_search_is_sensible(seven_b) -> None:
    w = Workload.from_config(seven_b)
    found = search(w, get_device("A100-80GB"), gpus=8)
    best = found["best"]
    assert best is not None and found["fitting"] > 10
    lay = best.layout
    assert lay.world_size == 8 and best.memory.fits
    # a 7B model fits one node without pipeline or 8-way tensor parallel; data ranks carry the batch
    assert lay.pp == 1 and lay.tp <= 2 and lay.data_ranks >= 4
    # every state that full replication would need (16 bytes/param = 108 GB) is sharded or split
    assert lay.sharding > 1 or lay.tp > 1
    # the seed's layout (dp 4, tp 2, recompute) fits but is ranked slower: TP all-reduces + recompute
    seed = Layout(dp=4, tp=2, micro_batch=2, recompute="full")
    assert estimate_layout(w, seed, get_device("A100-80GB")).fits
    assert step_time(w, seed, get_device("A100-80GB"))["total"] > best.step_time_s
    block = yaml_block(lay)
    assert block.startswith("parallel_config:") and f"sharding_parallel: {lay.sharding}" in block


def test_small_memory_forces_memory_savers(seven_b) -> None:
    w = Workload.from_config(seven_b)
    found = search(w, get_device("A100-40GB"), gpus=8)
    best = found["best"].layout
    assert best.recompute != "none" or best.stage >= 2 or best.tp > 1
    assert search(w, get_device("RTX4090"), gpus=1)["best"] is None  # 7B full FT on one 24 GB card


def test_cli_plan_and_search(repo_root) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--config", str(repo_root / SEVEN_B)])
    assert res.exit_code == 0, res.output
    for word in (
        "parameters",
        "gradients",
        "optimizer states",
        "master weights",
        "activations",
        "logits and loss",
        "comm buffers",
        "fits",
    ):
        assert word in res.output
    res = runner.invoke(app, ["plan", "--config", str(repo_root / SEVEN_B), "--search", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{") :])
    assert out["search"]["best_yaml"].startswith("parallel_config:")
    assert out["search"]["ranked"][0]["fits"]
    res = runner.invoke(
        app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "1", "--gpu_memory", "8GiB", "--search"]
    )
    assert res.exit_code == 0 and "nothing fits" in res.output


def test_validate_config_shows_estimate(repo_root) -> None:
    res = CliRunner().invoke(app, ["validate-config", str(repo_root / SEVEN_B)])
    assert res.exit_code == 0, res.output
    assert "memory" in res.output and "A100-80GB" in res.output


def test_memory_warning(seven_b) -> None:
    assert memory_warning(training_estimate(seven_b, device=get_device("A100-80GB"))) is None
    msg = memory_warning(training_estimate(seven_b, device=get_device("RTX4090")))
    assert msg is not None and "bmtrain plan" in msg


def test_fresh_model_takes_its_tokenizers_vocabulary(tmp_path) -> None:
    """The trainer sizes a fresh model's embedding and head by the tokenizer: so must the plan."""
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    texts = [f"record {i} says {'abc' * (i % 7)} and {i * 37 % 101}" for i in range(400)]
    tok = train_sentencepiece(texts, str(tmp_path / "tok"), vocab_size=300)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        "model_config: {family: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,\n"
        f"  num_attention_heads: 4, max_seq_len: 64, tokenizer_path: {tmp_path / 'tok'}}}\n"
        f"train_config: {{data_path: {tmp_path / 'x.jsonl'}, output_dir: {tmp_path / 'out'}}}\n"
    )
    cfg = load_config(str(cfg_path), mode="validate").config
    vocab = Workload.from_config(cfg).arch.vocab_size
    assert vocab == tok.vocab_size != 32000
    res = CliRunner().invoke(app, ["plan", "--config", str(cfg_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{") :])
    h, inter, layers = 64, 128, 2
    want = layers * (4 * h * h + 3 * h * inter + 2 * h) + h + 2 * vocab * h
    assert out["estimate"]["trainable_parameters"] == want


def _small(config, layers: int) -> Workload:
    w = Workload.from_config(config)
    arch = replace(
        w.arch,
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=1000,
    )
    return replace(w, arch=arch, seq_len=256, precision="fp32")


def test_cpu_offload_counts_the_host_states_in_the_peak(seven_b) -> None:
    """On a CPU the offloaded optimizer states are the same memory as everything else."""
    cpu = get_device("cpu")
    w = _small(seven_b, layers=2)
    plain = estimate_layout(w, Layout(micro_batch=1), cpu)
    off = estimate_layout(w, Layout(micro_batch=1, offload_optimizer=True), cpu)
    assert off.host_bytes > 0 and off.optimizer_states == 0
    assert off.peak >= plain.peak  # the host copy of the weights comes on top
    gpu = get_device("A100-80GB")
    assert (
        estimate_layout(w, Layout(micro_batch=1, offload_optimizer=True), gpu).peak
        < estimate_layout(w, Layout(micro_batch=1), gpu).peak
    )


def test_unfused_ops_and_partial_recompute_change_the_activations(seven_b) -> None:
    cpu = get_device("cpu")
    w = _small(seven_b, layers=4)
    fused = estimate_layout(w, Layout(micro_batch=2), cpu)
    reference = estimate_layout(replace(w, kernels="reference"), Layout(micro_batch=2), cpu)
    assert reference.activations > fused.activations
    full = estimate_layout(w, Layout(micro_batch=2, recompute="full"), cpu)
    half = estimate_layout(w, Layout(micro_batch=2, recompute="full", recompute_layers=2), cpu)
    assert full.activations < half.activations < fused.activations


def test_validate_config_shows_the_estimate(repo_root) -> None:
    res = CliRunner().invoke(app, ["validate-config", str(repo_root / "configs/quickstart.yaml")])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.strip().startswith("memory"))
    assert "peak per device on CPU with every batch at max_seq_len" in line and "fits" in line


def test_cli_plan_refuses_gpus_that_do_not_match_the_layout(repo_root) -> None:
    """`plan --gpus 3` on the 8-GPU config reported the 8-GPU layout as fitting."""
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "3"])
    assert res.exit_code == 2
    assert "--gpus 3 x --nodes 1 = 3 devices, but the config's layout needs 8" in res.output
    assert "--search" in res.output
    assert runner.invoke(app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "8"]).exit_code == 0
    assert (
        runner.invoke(
            app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "4", "--nodes", "2"]
        ).exit_code
        == 0
    )
    res = runner.invoke(app, ["plan", "--config", str(repo_root / SEVEN_B), "--gpus", "3", "--search"])
    assert res.exit_code == 0 and "search over 3 x" in res.output


def test_context_parallel_splits_the_activations(seven_b) -> None:
    """Each rank of a context group holds 1/cp of every row: its activations fall with the degree (the
    weights and optimizer states stay whole) and the plan says how many tokens each rank holds."""
    from dataclasses import replace

    w = replace(Workload.from_config(seven_b), seq_len=32768)
    dev = get_device("A100-80GB")
    one = estimate_layout(w, Layout(dp=8, micro_batch=1, recompute="full"), dev)
    cp = {
        n: estimate_layout(w, Layout(dp=8 // n, cp=n, micro_batch=1, recompute="full"), dev) for n in (2, 4)
    }
    assert Layout(dp=2, cp=4).world_size == 8
    assert cp[4].activations < cp[2].activations < one.activations
    assert cp[2].activations < 0.6 * one.activations and cp[4].activations < 0.35 * one.activations
    assert cp[4].parameters == one.parameters and cp[4].optimizer_states == one.optimizer_states
    assert any("activations of 16384 tokens per row on each rank" in n for n in cp[2].notes)


def test_cpu_peak_counts_the_matmul_throughput_probe(repo_root) -> None:
    """MFU's CPU figure times a 1536^3 matmul before the first step, beside the weights: on the
    quickstart model those four fp32 matrices are the peak (a run measured 37.7 MiB, docs/plan.md)."""
    from bmtrain_cli.machine import MATMUL_PROBE_N

    config = load_config(str(repo_root / "configs/quickstart.yaml")).config
    cpu = estimate(config, "cpu")
    assert cpu.peak == cpu.parameters + 4 * MATMUL_PROBE_N**2 * 4
    assert any("matmul throughput probe" in n for n in cpu.notes)
    gpu = estimate(config, "A100-80GB")  # no probe on a GPU (a table of peaks)
    assert gpu.peak < cpu.peak and not any("probe" in n for n in gpu.notes)
