"""Adapters-only checkpoints: size, PEFT layout, base path + hash, merge on export."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from bmtrain_cli.errors import UserError
from bmtrain_cli.lora import load_lora_checkpoint
from bmtrain_cli.train.lora_run import LoRARun
from tests.unit.lora.conftest import lora_cfg, tiny_model, write_lora_ckpt


def _logits(model, ids):
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


@pytest.fixture
def ids():
    return np.random.default_rng(3).integers(0, 96, (2, 12))


@pytest.fixture
def lora_ckpt(tmp_path):
    """A base model on disk and a LoRA checkpoint written by the trainer's writer (+ a tokenizer)."""
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.models import save_pretrained

    base_dir = tmp_path / "base"
    save_pretrained(tiny_model(), base_dir)
    model = tiny_model()
    cfg = Config.model_validate(
        {
            "model_config": {"model_name_or_path": str(base_dir)},
            "train_config": lora_cfg(["q_proj", "v_proj", "down_proj"]).model_dump(),
        }
    )
    run, ckpt = write_lora_ckpt(model, cfg, tmp_path)
    return {"base": base_dir, "ckpt": ckpt, "model": model, "run": run}


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_adapter_files_follow_the_umask(tmp_path, mask):
    """adapter_model.safetensors gets the mode of every other file (0644 under umask 022): a serving
    process or a teammate can read an exported adapter; umask 077 keeps it private."""
    from bmtrain_cli.lora.inject import lora_settings
    from bmtrain_cli.lora.merge import save_adapters

    model = tiny_model()
    LoRARun.start(model, lora_cfg(["q_proj"]))
    arrays = {n: p.numpy() for n, p in model.named_parameters() if ".lora_" in n}
    assert arrays
    old = os.umask(mask)
    try:
        out = save_adapters(str(tmp_path / "a"), lora_settings(model), arrays)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes) >= {"adapter_model.safetensors", "adapter_config.json"}
    assert set(modes.values()) == {0o666 & ~mask}, modes


def test_checkpoint_holds_adapters_only_and_is_small(lora_ckpt):
    ckpt, model = lora_ckpt["ckpt"], lora_ckpt["model"]
    assert not list(ckpt.glob("model*.safetensors"))
    tensors = load_file(str(ckpt / "adapter_model.safetensors"))
    n_adapter = sum(int(p.numel()) for n, p in model.named_parameters() if ".lora_" in n)
    assert sum(t.size for t in tensors.values()) == n_adapter
    adapter_bytes = (ckpt / "adapter_model.safetensors").stat().st_size
    base_bytes = (lora_ckpt["base"] / "model.safetensors").stat().st_size
    assert adapter_bytes < 4 * n_adapter + 8192
    assert adapter_bytes < 0.05 * base_bytes  # rank 4 on q, v, down of a 64-wide model: about 3%


def test_peft_layout(lora_ckpt):
    ckpt, model = lora_ckpt["ckpt"], lora_ckpt["model"]
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (
        cfg["r"] == 4
        and cfg["lora_alpha"] == 8.0
        and cfg["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    )
    assert cfg["base_model_name_or_path"] == str(lora_ckpt["base"].resolve())
    tensors = load_file(str(ckpt / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4)  # Hugging Face [out, in]
    ours = dict(model.named_parameters())
    np.testing.assert_array_equal(a, ours["model.layers.0.self_attn.q_proj.lora_A.weight"].numpy().T)
    record = json.loads((ckpt / "lora_base.json").read_text())
    assert len(record["base_model_sha256"]) == 64
    assert json.loads((ckpt / "config.json").read_text())["hidden_size"] == 64


def test_reload_and_merge(lora_ckpt, ids):
    want = _logits(lora_ckpt["model"], ids)
    again = load_lora_checkpoint(lora_ckpt["ckpt"], kernels="reference")
    np.testing.assert_allclose(_logits(again, ids), want, atol=1e-6, rtol=0)
    merged = load_lora_checkpoint(lora_ckpt["ckpt"], merge=True, kernels="reference")
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    np.testing.assert_allclose(_logits(merged, ids), want, atol=1e-4, rtol=0)
    assert np.abs(_logits(tiny_model(), ids) - want).max() > 1e-2


def test_missing_or_changed_base(lora_ckpt, tmp_path, ids):
    base, ckpt = lora_ckpt["base"], lora_ckpt["ckpt"]
    moved = tmp_path / "moved-base"
    shutil.move(str(base), str(moved))
    with pytest.raises(UserError, match="base model .* cannot be found"):
        load_lora_checkpoint(ckpt)
    # a copy elsewhere is accepted when its weights hash the same
    model = load_lora_checkpoint(ckpt, alternatives=[str(moved)], kernels="reference")
    np.testing.assert_allclose(_logits(model, ids), _logits(lora_ckpt["model"], ids), atol=1e-6)
    # a different base at the recorded path is refused
    from bmtrain_cli.models import save_pretrained

    save_pretrained(tiny_model(seed=5), base)
    with pytest.raises(UserError, match="weights changed since training"):
        load_lora_checkpoint(ckpt)
    (ckpt / "lora_base.json").unlink()
    with pytest.raises(UserError, match="LoRA adapters only"):
        load_lora_checkpoint(ckpt)


def _export(*args):
    from bmtrain_cli.cli import app

    r = CliRunner().invoke(app, ["export", *args])
    return r, (r.stdout or "") + (getattr(r, "stderr", "") or "")


def test_export_merges_by_default(lora_ckpt, tmp_path, ids):
    from bmtrain_cli.models import load_pretrained

    out = tmp_path / "merged"
    r, text = _export("-c", str(lora_ckpt["ckpt"]), "-o", str(out), "--format", "hf")
    assert r.exit_code == 0, text
    merged = load_pretrained(str(out), kernels="reference")
    np.testing.assert_allclose(_logits(merged, ids), _logits(lora_ckpt["model"], ids), atol=1e-4, rtol=0)


def test_export_no_merge_writes_peft(lora_ckpt, tmp_path, ids):
    out = tmp_path / "peft"
    r, text = _export("-c", str(lora_ckpt["ckpt"]), "-o", str(out), "--no-merge")
    assert r.exit_code == 0, text
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not list(out.glob("model*.safetensors"))
    assert (out / "tokenizer.model").is_file()
    again = load_lora_checkpoint(out, kernels="reference")  # the export keeps the base record too
    np.testing.assert_allclose(_logits(again, ids), _logits(lora_ckpt["model"], ids), atol=1e-6)


def test_generate_and_eval_open_a_lora_checkpoint(lora_ckpt, tmp_path):
    """`bmtrain eval/generate --model_path` on a LoRA checkpoint (adapters + recorded base) merge it:
    the same loss as the merged hf export, and not the base model's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from bmtrain_cli.cli import app

    ckpt = lora_ckpt["ckpt"]
    data = tmp_path / "data" / "heldout.jsonl"
    small = tmp_path / "small.jsonl"
    small.write_text("".join(data.read_text(encoding="utf-8").splitlines(True)[:16]), encoding="utf-8")
    # a tokenizer that fits the tiny model's 96-token vocabulary (the fixture's has byte pieces)
    for f in ckpt.glob("tokenizer*"):
        f.unlink()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=90, limit_alphabet=60, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(data.read_text(encoding="utf-8").splitlines(), trainer)
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    merged = tmp_path / "merged"
    r, text = _export("-c", str(ckpt), "-o", str(merged), "--format", "hf")
    assert r.exit_code == 0, text

    def loss(path, *extra):
        r = CliRunner().invoke(
            app, ["eval", "--model_path", str(path), "--data_path", str(small), "--json", *extra]
        )
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["loss"]

    want = loss(merged)
    assert loss(ckpt) == pytest.approx(want, rel=1e-5)
    assert abs(loss(lora_ckpt["base"], "--tokenizer_path", str(ckpt)) - want) > 1e-3
    r = CliRunner().invoke(
        app, ["generate", "--model_path", str(ckpt), "--prompt", "ab", "--max_new_tokens", "3"]
    )
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("extra", [["--quantize", "int8"], ["--format", "paddle-inference"]])
def test_export_no_merge_refuses_what_it_cannot_write(lora_ckpt, tmp_path, extra):
    """--no-merge writes fp32 PEFT adapters; asking for INT8 or a Paddle Inference graph at the same time
    is an error, not a silently different export."""
    out = tmp_path / "x"
    r, text = _export("-c", str(lora_ckpt["ckpt"]), "-o", str(out), "--no-merge", *extra)
    assert r.exit_code == 2 and "drop --no-merge" in text and "Traceback" not in text
    assert not out.exists()
    r, text = _export("-c", str(lora_ckpt["ckpt"]), "-o", str(out), "--no-merge", "--format", "hf")
    assert r.exit_code == 0, text
    assert (out / "adapter_model.safetensors").is_file()


def test_export_missing_base_is_a_clear_error(lora_ckpt, tmp_path):
    shutil.rmtree(lora_ckpt["base"])
    r, text = _export("-c", str(lora_ckpt["ckpt"]), "-o", str(tmp_path / "x"), "--format", "hf")
    assert r.exit_code == 2 and "cannot be found" in text and "Traceback" not in text
