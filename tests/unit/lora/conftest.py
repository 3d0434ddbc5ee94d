"""A tiny decoder and LoRA settings shared by the LoRA tests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.tiny import ARCH as TINY

ARCH = replace(TINY, vocab_size=96)


def lora_cfg(targets="all-linear", rank=4, alpha=8.0, dropout=0.0, **kw):
    from bmtrain_cli.config.schema import TrainConfig

    return TrainConfig(
        finetuning="lora",
        lora_rank=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        lora_target_modules=targets,
        learning_rate=1e-2,
        **kw,
    )


def tiny_model(arch=ARCH, seed=0, kernels="reference"):
    import paddle

    from bmtrain_cli.models.decoder import CausalLM

    paddle.seed(seed)
    m = CausalLM(arch, kernels=kernels)
    m.init_weights()
    m.eval()
    return m


def write_lora_ckpt(model, cfg, tmp_path):
    """LoRA on ``model`` (random adapters), its base recorded from ``cfg`` and the checkpoint the trainer's
    writer makes of it in tmp_path/step-3, with a demo tokenizer; returns (run, checkpoint directory)."""
    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data
    from bmtrain_cli.train.lora_run import LoRARun

    run = LoRARun.start(model, cfg.train)
    randomize_adapters(model)
    run.record_base(cfg, tmp_path / "out", model)
    ckpt = tmp_path / "step-3"
    ckpt.mkdir()
    run.weights_writer(model)(model, str(ckpt))
    train, held = write_demo_data(str(tmp_path / "data"))
    train_demo_tokenizer(str(ckpt), [train, held])
    return run, ckpt


def randomize_adapters(model, seed=1, scale=0.2):
    """Non-zero B (and A) so that the adapters change the output."""
    import paddle

    rng = np.random.default_rng(seed)
    for n, p in model.named_parameters():
        if ".lora_" in n:
            p.set_value(paddle.to_tensor(rng.normal(0, scale, p.shape).astype("float32")))


@pytest.fixture
def batch():
    import paddle

    rng = np.random.default_rng(0)
    ids = rng.integers(0, ARCH.vocab_size, (2, 16))
    labels = ids.copy()
    labels[:, :3] = -100
    mask = np.ones_like(ids)
    mask[1, 8:] = 2  # packed row: two segments
    pos = np.tile(np.arange(16), (2, 1))
    pos[1, 8:] = np.arange(8)
    return {
        k: paddle.to_tensor(v)
        for k, v in dict(input_ids=ids, labels=labels, attention_mask=mask, position_ids=pos).items()
    }
