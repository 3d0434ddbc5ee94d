"""LoRA on the decoder: step-0 equality, frozen base, merge/unmerge, errors, trainable counts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from bmtrain_cli.errors import UserError
from bmtrain_cli.lora import apply_lora, lora_layers, merge_lora, strip_lora, trainable_count, unmerge_lora
from tests.unit.lora.conftest import ARCH, lora_cfg, randomize_adapters, tiny_model


def _logits(model, batch):
    with paddle.no_grad():
        return model(batch["input_ids"], batch["attention_mask"], batch["position_ids"]).numpy()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["down_proj"]])
def test_step0_output_equals_base(batch, targets):
    model = tiny_model()
    base = _logits(model, batch)
    names = apply_lora(model, lora_cfg(targets))
    assert names and all(n.startswith("model.layers.") for n in names)
    np.testing.assert_array_equal(_logits(model, batch), base)
    # B is zero and A is not: the update is exactly zero at step 0, but A carries signal for later steps
    for _, layer in lora_layers(model):
        assert float(paddle.abs(layer.lora_B.weight).max()) == 0.0
        assert float(paddle.abs(layer.lora_A.weight).max()) > 0.0


def test_names_stay_hugging_face_and_adapters_use_peft_names():
    model = tiny_model()
    apply_lora(model, lora_cfg(["q_proj"]))
    names = [n for n, _ in model.named_parameters()]
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names
    assert "model.layers.0.self_attn.q_proj.lora_B.weight" in names
    assert not any("base_layer" in n for n in names)
    layer = dict(lora_layers(model))["model.layers.0.self_attn.q_proj"]
    assert layer.lora_A.weight.shape == [64, 4] and layer.lora_B.weight.shape == [4, 64]


def test_only_adapters_get_gradients_and_optimizer_state(batch):
    from bmtrain_cli.train.checkpoint.optimizer_state import optimizer_state
    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    model = tiny_model()
    apply_lora(model, lora_cfg("all-linear"))
    model.train()
    cfg = lora_cfg("all-linear")
    opt = build_optimizer(model, cfg, 1e-2)
    for _ in range(2):  # B is zero at step 0, so A's gradient only appears from step 2 on
        loss, count = model.loss_sum(**batch)
        (loss / count).backward()
        grads = {n: (None if p.grad is None else p.grad.numpy()) for n, p in model.named_parameters()}
        opt.step()
        if _ == 0:
            first = grads
        opt.clear_grad(set_to_zero=False)
    base_names = [n for n in first if ".lora_" not in n]
    assert base_names and all(first[n] is None for n in base_names)
    assert all(first[n] is not None for n in first if ".lora_B." in n)
    assert any(np.abs(first[n]).max() > 0 for n in first if ".lora_B." in n)
    tensors, _ = optimizer_state(opt, model)
    owners = {k.split("::")[0] for k in tensors if not k.startswith("::")}
    assert owners and all(".lora_" in o for o in owners)
    lora_names = {n for n, _ in model.named_parameters() if ".lora_" in n}
    assert owners == lora_names


def test_frozen_base_is_unchanged_by_training(batch):
    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    model = tiny_model()
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    apply_lora(model, lora_cfg("all-linear"))
    model.train()
    opt = build_optimizer(model, lora_cfg(weight_decay=0.1), 1e-2)
    losses = []
    for _ in range(4):
        loss, count = model.loss_sum(**batch)
        (loss / count).backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss / count))
    assert losses[-1] < losses[0]
    after = dict(model.named_parameters())
    for n, arr in before.items():
        np.testing.assert_array_equal(after[n].numpy(), arr)


def test_merge_unmerge_and_strip(batch):
    model = tiny_model()
    apply_lora(model, lora_cfg("all-linear"))
    randomize_adapters(model)
    unmerged = _logits(model, batch)
    assert np.abs(unmerged - _logits(tiny_model(), batch)).max() > 1e-2  # the adapters matter
    w0 = model.model.layers[0].mlp.down_proj.weight.numpy().copy()
    assert merge_lora(model) == 14
    np.testing.assert_allclose(_logits(model, batch), unmerged, atol=1e-4, rtol=0)
    unmerge_lora(model)
    np.testing.assert_allclose(model.model.layers[0].mlp.down_proj.weight.numpy(), w0, atol=1e-6)
    plain = strip_lora(model)
    assert not lora_layers(plain)
    assert not any(".lora_" in n for n, _ in plain.named_parameters())
    np.testing.assert_allclose(_logits(plain, batch), unmerged, atol=1e-4, rtol=0)


def test_dropout_only_in_training(batch):
    model = tiny_model()
    apply_lora(model, lora_cfg("all-linear", dropout=0.5))
    randomize_adapters(model)
    model.eval()
    a, b = _logits(model, batch), _logits(model, batch)
    np.testing.assert_array_equal(a, b)
    model.train()
    assert np.abs(_logits(model, batch) - a).max() > 1e-4


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_composes_with_recompute_and_packing(batch, kernels):
    """Gradient checkpointing gives the same loss and adapter gradients; packed rows run through."""

    def grads(recompute):
        model = tiny_model(kernels=kernels)
        apply_lora(model, lora_cfg("all-linear"))
        randomize_adapters(model)
        if recompute:
            model.enable_recompute("full")
        model.train()
        loss, count = model.loss_sum(**batch)
        (loss / count).backward()
        return float(loss), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}

    l0, g0 = grads(False)
    l1, g1 = grads(True)
    assert abs(l0 - l1) < 1e-6 and set(g0) == set(g1) and all(".lora_" in n for n in g0)
    for n in g0:
        np.testing.assert_allclose(g1[n], g0[n], atol=1e-6)


def test_unknown_target_lists_available():
    model = tiny_model()
    with pytest.raises(UserError) as info:
        apply_lora(
            model, SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0, lora_target_modules=["qq_proj"])
        )
    msg = str(info.value)
    assert (
        "qq_proj" in msg
        and "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all-linear" in msg
    )
    with pytest.raises(UserError, match="not in this model.*'W_pack'"):
        apply_lora(
            model, SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0, lora_target_modules="W_pack")
        )
    assert trainable_count(model) == sum(int(p.numel()) for p in model.parameters())  # untouched


@pytest.mark.parametrize("rank", [0, -2])
def test_rank_must_be_positive(rank):
    with pytest.raises(UserError, match="lora_rank must be > 0"):
        apply_lora(
            tiny_model(),
            SimpleNamespace(lora_rank=rank, lora_alpha=8, lora_dropout=0, lora_target_modules="all-linear"),
        )


def test_fused_w_pack_target():
    import dataclasses

    arch = dataclasses.replace(ARCH, family="baichuan", fused_qkv=True, num_key_value_heads=4)
    model = tiny_model(arch)
    names = apply_lora(model, lora_cfg(["W_pack"]))
    assert names == ["model.layers.0.self_attn.W_pack", "model.layers.1.self_attn.W_pack"]


@pytest.mark.parametrize(
    "family,targets,extra",
    [
        ("llama", "all-linear", {}),
        ("llama", ["q_proj", "v_proj"], {}),
        ("qwen2", ["k_proj", "o_proj", "up_proj"], {}),
        ("baichuan", "all-linear", {"num_key_value_heads": 4}),
    ],
)
def test_validate_config_trainable_count_matches_real(family, targets, extra):
    """validate-config's trainable count (commands/summary.py) equals the parameters LoRA really adds."""
    from bmtrain_cli.commands.summary import summarize
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.models.arch import arch_from_model_config
    from bmtrain_cli.models.param_count import count_parameters

    mc = dict(
        family=family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_seq_len=32,
    )
    mc.update(extra)
    cfg = Config.model_validate(
        {
            "model_config": mc,
            "train_config": {"finetuning": "lora", "lora_rank": 4, "lora_target_modules": targets},
        }
    )
    s = summarize(cfg)
    arch = arch_from_model_config(cfg.model)
    model = tiny_model(arch)
    assert s["parameters"] == count_parameters(arch) == sum(int(p.numel()) for p in model.parameters())
    apply_lora(model, cfg.train)
    real = trainable_count(model)
    assert s["trainable_parameters"] == real > 0
    total = sum(int(p.numel()) for p in model.parameters())
    assert abs(s["trainable_share"] - real / total) < 1e-12


def test_initial_adapters_depend_on_seed_and_layer_name_only():
    """A is drawn from (train_config.seed, layer name): the same whatever Paddle's random stream did
    before (a different tensor-parallel degree builds differently sized shards), different per layer
    and per seed."""
    import paddle

    from bmtrain_cli.lora.merge import adapter_arrays

    def adapters(seed, model_seed, draws):
        m = tiny_model(seed=model_seed)
        paddle.uniform([draws])  # consume some of Paddle's stream, as a different build would
        apply_lora(m, lora_cfg(seed=seed))
        return adapter_arrays(m)

    a, b, c = adapters(1, 0, 7), adapters(1, 3, 1000), adapters(2, 0, 7)
    q0, q1 = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.1.self_attn.q_proj.lora_A.weight"
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.allclose(a[q0], a[q1]) and not np.allclose(a[q0], c[q0])
    assert np.abs(a[q0]).max() <= 1 / np.sqrt(64) and np.abs(a[q0]).max() > 0
