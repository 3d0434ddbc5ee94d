"""A tiny trained checkpoint (training-checkpoint layout) shared by the export tests."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

TRAIN_STEPS = 60


def _batches(samples, batch, rng):
    order = rng.permutation(len(samples))
    for i in range(0, len(order) - batch + 1, batch):
        chunk = [samples[j] for j in order[i : i + batch]]
        width = max(len(ids) for ids, _ in chunk)
        ids = np.zeros((batch, width), np.int64)
        labels = np.full((batch, width), -100, np.int64)
        mask = np.zeros((batch, width), np.int64)
        for r, (x, y) in enumerate(chunk):
            ids[r, : len(x)], labels[r, : len(y)], mask[r, : len(x)] = x, y, 1
        yield ids, labels, mask


def make_checkpoint(root: Path, steps: int = TRAIN_STEPS, tie: bool = False, intermediate: int = 256) -> Path:
    """Train a 2-layer hidden-64 LLaMA on the arithmetic demo task for ``steps`` AdamW steps and write a
    checkpoint as the trainer does: output_dir/checkpoints/step-N + latest. Returns the run dir."""
    import paddle

    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data
    from bmtrain_cli.data.encode import encode_eval_file
    from bmtrain_cli.models import build, save_pretrained
    from bmtrain_cli.models.arch import ModelArch

    paddle.seed(0)
    data = root / "data"
    train, held = write_demo_data(str(data))
    tok = train_demo_tokenizer(str(data / "tok"), [train], vocab_size=300)
    arch = ModelArch(
        family="llama",
        hidden_size=64,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=tok.vocab_size,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
    )
    model = build(replace(arch), kernels="reference")
    samples = encode_eval_file(train, tok, max_records=2000)
    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters())
    rng = np.random.default_rng(0)
    step = 0
    while step < steps:
        for ids, labels, mask in _batches(samples, 32, rng):
            loss_sum, count = model.loss_sum(
                paddle.to_tensor(ids), paddle.to_tensor(labels), paddle.to_tensor(mask)
            )
            (loss_sum / count).backward()
            opt.step()
            opt.clear_grad()
            step += 1
            if step >= steps:
                break
    model.eval()
    run = root / "run"
    ckpt = run / "checkpoints" / f"step-{steps}"
    save_pretrained(model, str(ckpt))
    tok.save(str(ckpt))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": steps}), encoding="utf-8")
    (run / "checkpoints" / "latest").write_text(f"step-{steps}\n", encoding="utf-8")
    return run


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("export_ckpt"))


@pytest.fixture(scope="session")
def heldout(trained_run) -> str:
    return str(trained_run.parent / "data" / "heldout.jsonl")
