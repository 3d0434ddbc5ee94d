"""`bmtrain train` end to end on a tiny model (in process): outputs, refusal, resume, robustness."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from tests.tiny import model_yaml
from tests.tree import tree_digest

TINY = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """
train_config:
  demo_data: arithmetic
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 8
  global_batch_size: 16
  learning_rate: 3.0e-3
  warmup_steps: 2
  logging_steps: 1
  save_steps: 3
  eval_steps: 3
  num_workers: 0
"""
)


def _config(tmp_path: Path, steps: int = 6, out: str = "out") -> str:
    p = tmp_path / f"cfg-{out}.yaml"
    p.write_text(TINY.format(out=tmp_path / out, steps=steps), encoding="utf-8")
    return str(p)


def _train(*args: str):
    return CliRunner().invoke(app, ["train", *args], catch_exceptions=False)


def _losses(out: Path):
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    cfg = _config(tmp)
    res = _train("--config", cfg)
    assert res.exit_code == 0, res.output
    return tmp, cfg, res.output


def test_outputs_of_a_run(trained):
    tmp, _, output = trained
    out = tmp / "out"
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "steps",
        "final_loss",
        "best_eval_loss",
        "tokens_per_sec",
        "peak_memory_bytes",
        "wall_time_s",
    ):
        assert summary[key] is not None, key
    assert summary["steps"] == 6 and summary["peak_memory_bytes"] > 0
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    assert all({"step", "loss", "lr", "grad_norm", "tokens_per_sec"} <= set(r) for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert (out / "config.yaml").is_file() and (out / "loss_curve.png").stat().st_size > 1000
    assert (
        "held-out accuracy: before" in output and "checkpoint" in output and "tensorboard --logdir" in output
    )

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "logs"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "train/memory"}
    assert want | {"eval/loss", "eval/ppl"} <= tags
    assert (out / "logs" / "hparams").is_dir()


def test_start_says_which_attention_kernel(trained):
    """Right-padded batches of 24 tokens on a CPU with kernels: reference (so not our fused attention):
    matmul + softmax (short) without a mask, and why."""
    _, _, output = trained
    line = next(x for x in output.splitlines() if x.startswith("attention: "))
    assert line.startswith("attention: sdpa_causal (CPU, 24 <= 256 tokens") and "need no mask" in line


def test_checkpoint_is_hf_loadable(trained):
    tmp, _, _ = trained
    ck = tmp / "out" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-6"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-3", "step-6"]
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.models import load_pretrained

    model = load_pretrained(str(ck / "step-6"), kernels="reference")
    tok = load_tokenizer(str(ck / "step-6"))
    assert model.arch.vocab_size == tok.vocab_size
    assert (ck / "step-6" / "model.safetensors").is_file()
    state = json.loads((ck / "step-6" / "trainer_state.json").read_text())
    # export's eval-loss comparison reads the file this run evaluated on (the demo's held-out split)
    assert state["eval_data_path"] == str((tmp / "out" / "data" / "heldout.jsonl").resolve())
    assert state["optimizer_layout"]["portable"] is True
    assert state["optimizer_layout"]["optimizer_files"] == ["optimizer.safetensors"]


def test_refuses_output_dir_of_another_run(trained):
    _, cfg, _ = trained
    res = CliRunner().invoke(app, ["train", "--config", cfg])
    assert res.exit_code == 2
    assert "already holds checkpoints" in res.output and "--resume" in res.output


def test_resume_continues_exactly(trained, tmp_path):
    src, cfg, _ = trained
    out = tmp_path / "out"
    shutil.copytree(src / "out", out)
    shutil.rmtree(out / "checkpoints" / "step-6")
    (out / "checkpoints" / "latest").write_text("step-3\n")
    res = _train("--config", cfg, "--output_dir", str(out), "--resume")
    assert res.exit_code == 0, res.output
    assert "resumed from step-3" in res.output
    assert _losses(out) == _losses(src / "out")
    # the final-loss window is carried by the checkpoint: a resumed run reports the same final_loss
    got = json.loads((out / "summary.json").read_text())
    want = json.loads((src / "out" / "summary.json").read_text())
    assert got["final_loss"] == want["final_loss"] and got["final_loss"] is not None


def test_resume_of_a_finished_run_keeps_its_summary(trained, tmp_path):
    src, cfg, _ = trained
    out = tmp_path / "out"
    shutil.copytree(src / "out", out)
    res = _train("--config", cfg, "--output_dir", str(out), "--resume")
    assert res.exit_code == 0, res.output
    got = json.loads((out / "summary.json").read_text())
    want = json.loads((src / "out" / "summary.json").read_text())
    assert got["steps"] == 6 and got["final_loss"] == want["final_loss"]
    assert got["tokens_per_sec"] > 0


def test_half_precision_refused_on_cpu(tmp_path):
    res = CliRunner().invoke(
        app, ["train", "--config", _config(tmp_path), "--set", "train_config.precision=bf16"]
    )
    assert res.exit_code == 2 and "GPU" in res.output


def test_non_finite_steps_are_skipped_then_stop(tmp_path, monkeypatch):
    from bmtrain_cli.models.decoder import CausalLM

    real = CausalLM.loss_sum
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        s, c = real(self, *a, **k)
        calls["n"] += 1
        # micro-batches 3-4 (= optimizer step 2) get a NaN, then every step from step 4 on
        return (s * float("nan"), c) if calls["n"] in (3, 4) or calls["n"] > 6 else (s, c)

    monkeypatch.setattr(CausalLM, "loss_sum", poisoned)
    cfg = _config(tmp_path, steps=10)
    res = CliRunner().invoke(
        app,
        [
            "train",
            "--config",
            cfg,
            "--set",
            "train_config.max_nonfinite_steps=3",
            "--set",
            "train_config.eval_steps=100",
        ],
    )
    assert res.exit_code == 1, res.output
    assert "3 consecutive steps had a non-finite loss" in res.output
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["step"] for r in recs if r.get("event") == "nonfinite_skipped"]
    assert skipped == [2, 4, 5, 6]
    assert [r["step"] for r in recs if "loss" in r and "event" not in r] == [1, 3]


def test_sigterm_saves_a_checkpoint(tmp_path, monkeypatch):
    from bmtrain_cli.train.run import load_recipe

    recipe = load_recipe("sft")
    real = recipe.train_step

    def step_then_signal(parts, step, micro):
        out = real(parts, step, micro)
        if step == 1:  # the step being run is step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(recipe, "train_step", step_then_signal)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    res = CliRunner().invoke(app, ["train", "--config", _config(tmp_path, steps=8)])
    assert res.exit_code == 143, res.output
    assert "SIGTERM received: stopped at step 2/8" in res.output
    # the in-process run leaves the caller's handlers as it found them
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    ck = tmp_path / "out" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-2"


def test_failed_save_keeps_earlier_checkpoint(tmp_path, monkeypatch):
    import errno

    import safetensors.numpy as stn

    from bmtrain_cli.train.checkpoint import training_state as ckmod

    real = ckmod.save_checkpoint

    def full_disk_after_first(root, step, **kw):
        if step > 3:

            def boom(*a, **k):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))

            monkeypatch.setattr(stn, "save_file", boom)
        return real(root, step, **kw)

    monkeypatch.setattr(ckmod, "save_checkpoint", full_disk_after_first)
    res = CliRunner().invoke(app, ["train", "--config", _config(tmp_path, steps=6)])
    assert res.exit_code == 2, res.output
    assert f"no space left on {tmp_path / 'out' / 'checkpoints'}" in res.output and "step-3" in res.output
    ck = tmp_path / "out" / "checkpoints"
    assert (ck / "latest").read_text().strip() == "step-3"
    assert (ck / "step-3" / "trainer_state.json").is_file()


@pytest.mark.parametrize("granularity", ["full", "attention"])
def test_gradient_checkpointing_gives_identical_training(trained, tmp_path, granularity):
    src, cfg, _ = trained
    res = _train(
        "--config",
        cfg,
        "--output_dir",
        str(tmp_path / "rc"),
        "--set",
        "train_config.gradient_checkpointing=true",
        "--set",
        f"train_config.recompute_granularity={granularity}",
    )
    assert res.exit_code == 0, res.output

    def grad_norms(out):
        recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        return [r["grad_norm"] for r in recs if "grad_norm" in r]

    got, want = _losses(tmp_path / "rc"), _losses(src / "out")
    if granularity == "full":  # the same kernels run again: bit-identical
        assert got == want
        assert grad_norms(tmp_path / "rc") == grad_norms(src / "out")
    else:  # the recomputed attention core may take another (equivalent) kernel path
        assert got.keys() == want.keys()
        assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)
        assert grad_norms(tmp_path / "rc") == pytest.approx(grad_norms(src / "out"), rel=1e-4)


def test_skipped_bad_records_are_reported(tmp_path):
    good = [json.dumps({"instruction": f"add {i} and {i}", "output": str(2 * i)}) for i in range(24)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(good[:5] + ['{"instruction": "x"', '{"input": "y"}'] + good[5:]) + "\n")
    cfg = _config(tmp_path, steps=3)
    res = _train(
        "--config",
        cfg,
        "--data_path",
        str(data),
        "--set",
        "train_config.demo_data=null",
        "--set",
        "train_config.on_bad_record=skip",
    )
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    assert "24 training samples from 26 records" in res.output
    assert f"2 skipped (on_bad_record: skip): 2 training record(s) in {out / 'rejected.jsonl'}" in res.output
    assert json.loads((out / "summary.json").read_text())["rejected_records"] == 2
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [6, 7]


def test_unreadable_data_is_named_and_leaves_no_output_dir(tmp_path):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"instruction": "x"\n')
    cfg = _config(tmp_path, steps=3)
    res = CliRunner().invoke(
        app, ["train", "--config", cfg, "--data_path", str(data), "--set", "train_config.demo_data=null"]
    )
    assert res.exit_code == 2, res.output
    assert f"{data}:1: invalid JSON" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "out").exists()  # nothing was written, so nothing is left behind
    # an output_dir that existed before the run is left as it was
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    res = CliRunner().invoke(
        app, ["train", "--config", cfg, "--data_path", str(data), "--set", "train_config.demo_data=null"]
    )
    assert res.exit_code == 2 and (tmp_path / "out" / "notes.txt").read_text() == "mine"


def _previous_run(trained, tmp_path: Path) -> Path:
    src, _, _ = trained
    out = tmp_path / "out"
    shutil.copytree(src / "out", out)
    return out


def test_failing_overwrite_run_deletes_nothing(trained, tmp_path):
    """With --overwrite, the previous run's checkpoints were deleted before the model was even built;
    a run that then failed lost them. Nothing is removed before every check has passed."""
    out = _previous_run(trained, tmp_path)
    before = tree_digest(out)
    cfg = _config(tmp_path, steps=3)
    huge = ["--set", "model_config.hidden_size=65536", "--set", "model_config.intermediate_size=131072"]
    res = CliRunner().invoke(app, ["train", "--config", cfg, "--overwrite", *huge])
    assert res.exit_code == 2, res.output
    assert "the model's weights alone need" in res.output and "Traceback" not in res.output
    assert tree_digest(out) == before
    res = CliRunner().invoke(app, ["train", "--config", cfg, "--overwrite", "--set", "train_config.seed=-1"])
    assert res.exit_code == 2 and "train_config.seed" in res.output
    assert tree_digest(out) == before


def test_out_of_memory_at_model_build_is_one_line(trained, tmp_path, monkeypatch):
    from bmtrain_cli.train import setup

    out = _previous_run(trained, tmp_path)
    before = tree_digest(out)

    def no_memory(*args):
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr(setup, "build_model_and_optimizer", no_memory)
    res = CliRunner().invoke(app, ["train", "--config", _config(tmp_path, steps=3), "--overwrite"])
    assert res.exit_code == 2, res.output
    assert "out of memory while building the model and optimizer (the memory plan estimates" in res.output
    assert tree_digest(out) == before


def test_overwrite_replaces_the_previous_outputs_once_checks_pass(trained, tmp_path):
    out = _previous_run(trained, tmp_path)
    (out / "checkpoints" / ".tmp-step-9-12345").mkdir()  # a save killed mid-way
    (out / "notes.txt").write_text("mine")
    res = _train("--config", _config(tmp_path, steps=3), "--overwrite", "--set", "train_config.save_steps=1")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-1", "step-2", "step-3"]
    assert (out / "notes.txt").read_text() == "mine" and not (out / "rejected.jsonl").exists()


def test_configured_vocab_size_is_honoured(tmp_path):
    """vocab_size above the tokenizer's (padding) is the model's; it used to be replaced silently."""
    cfg = _config(tmp_path, steps=3)
    res = _train("--config", cfg, "--set", "model_config.vocab_size=512")
    assert res.exit_code == 0, res.output
    hf = json.loads((tmp_path / "out" / "checkpoints" / "step-3" / "config.json").read_text())
    assert hf["vocab_size"] == 512


def test_non_finite_weights_are_never_saved_nor_reported_as_success(tmp_path):
    """learning_rate .inf trained, wrote a checkpoint of all-NaN weights and exited 0."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.train.loop.stopping import TrainingStopped
    from bmtrain_cli.train.run import load_recipe

    sft = load_recipe("sft")
    parts, state = sft.setup(load_config(_config(tmp_path, steps=4), mode="train"))

    def poison(parts, state, out):
        if state.step == 3:  # after step 3's checkpoint, as an update with an infinite step size would
            w = parts.model.raw.parameters()[0]
            w.set_value(w * float("inf"))

    with pytest.raises(TrainingStopped) as info:
        sft.train(parts, state, poison)
    assert info.value.exit_code == 2 and "the weights hold inf or NaN" in str(info.value)
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-3"]
    assert not (tmp_path / "out" / "summary.json").exists()


def test_resume_removes_half_written_saves(trained, tmp_path):
    """After kill -9 during a save, --resume left .tmp-step-N-PID behind (docs say the next start removes it)."""
    out = _previous_run(trained, tmp_path)
    stale = out / "checkpoints" / ".tmp-step-7-4242"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    _, cfg, _ = trained
    res = _train("--config", cfg, "--output_dir", str(out), "--resume")
    assert res.exit_code == 0, res.output
    assert not stale.exists()


@pytest.mark.slow
def test_custom_kernels_train_with_the_fused_cpu_attention(tmp_path):
    """kernels: custom on a CPU: the run says it attends with the fused CPU kernel, and trains."""
    cfg = tmp_path / "cfg.yaml"
    text = TINY.replace(model_yaml(max_seq_len=24, kv_heads=None), model_yaml(24, None, "custom"))
    cfg.write_text(text.format(out=tmp_path / "out", steps=3), encoding="utf-8")
    res = _train("--config", str(cfg))
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("attention: "))
    assert line.startswith("attention: cpu_fused (CPU: fused C++ attention kernel"), line
    losses = _losses(tmp_path / "out")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses.values()), losses
