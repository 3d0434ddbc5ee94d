"""LoRA on the experts of a mixture of experts (lora_target_modules gate_proj / up_proj / down_proj or
all-linear): every routed expert gets its own adapters, the grouped GEMM keeps running (each wrapped
projection as base + scaling * A @ B) and the adapters' gradients equal those of the per-expert reference
composition; the merged export reproduces the adapted model in ours and in transformers, and the adapters
alone (the checkpoint and `export --no-merge`) load in PEFT onto transformers 5.x's stacked experts."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from bmtrain_cli.lora.inject import apply_lora
from bmtrain_cli.lora.layers import LoRALinear
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.moe import SparseMoE
from bmtrain_cli.ops import select
from tests.unit.lora.conftest import randomize_adapters
from tests.unit.models.test_moe import FIXTURES, _fresh_arch

EXPERT_PROJS = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ext():
    from bmtrain_cli.ops.build import load_extension

    return load_extension()


def _settings(targets, dropout=0.0):
    return SimpleNamespace(
        lora_rank=3, lora_alpha=6, lora_dropout=dropout, lora_target_modules=targets, seed=0
    )


def _moe_layer_with_adapters(mode: str, dropout: float = 0.0) -> SparseMoE:
    arch = replace(_fresh_arch(), num_experts=5, num_experts_per_tok=2)
    paddle.seed(11)
    layer = SparseMoE(arch, select(mode, device="cpu"))
    layer.to(dtype="float32")
    holder = paddle.nn.LayerList([layer])  # apply_lora walks sublayers
    apply_lora(holder, _settings(EXPERT_PROJS, dropout))
    randomize_adapters(holder, seed=4, scale=0.3)
    return layer


def test_adapters_on_the_experts_train_through_the_grouped_gemm(ext):
    """Output and every adapter's gradient with the grouped GEMM equal the reference composition's (Paddle
    matmuls expert by expert through the LoRA layers), and the grouped GEMM really ran."""
    from bmtrain_cli.ops import moe_experts

    calls = []
    real = moe_experts.grouped_experts

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 9, 32)).astype("float32"))
    results = []
    for mode in ("custom", "reference"):
        layer = _moe_layer_with_adapters(mode)
        if mode == "custom":
            layer.grouped = counting
        assert all(isinstance(e.gate_proj, LoRALinear) for e in layer.experts)
        y = layer(x)
        (y * y).sum().backward()
        grads = {n: p.grad.numpy() for n, p in layer.named_parameters() if not p.stop_gradient}
        assert len(grads) == 2 * 3 * 5  # A and B of gate/up/down of each of the 5 experts
        assert all(p.grad is None for p in layer.parameters() if p.stop_gradient)  # base frozen
        results.append((y.numpy(), grads))
    assert calls == [1]
    (y0, g0), (y1, g1) = results
    np.testing.assert_allclose(y0, y1, rtol=1e-4, atol=1e-5)
    assert sorted(g0) == sorted(g1)
    touched = 0
    for name in g0:
        scale = float(np.abs(g1[name]).max())  # fp32 sums in another order: round-off relative to the tensor
        np.testing.assert_allclose(g0[name], g1[name], rtol=1e-4, atol=1e-5 * scale, err_msg=name)
        touched += bool(np.abs(g0[name]).max() > 0)
    assert touched >= 2 * 3 * 3  # most experts got tokens: the comparison is not of zeros


def test_dropout_and_disabled_adapters_on_the_experts(ext):
    """LoRA dropout while training has no single weight: the layer runs the reference composition; with
    the adapters off (DPO's reference) the grouped GEMM runs the base weights."""
    x = paddle.to_tensor(np.random.default_rng(1).standard_normal((1, 6, 32)).astype("float32"))
    layer = _moe_layer_with_adapters("custom", dropout=0.1)
    layer.train()
    calls = []
    real = layer.grouped
    layer.grouped = lambda *a: calls.append(1) or real(*a)
    layer(x)
    assert calls == []
    layer.eval()
    with_adapters = layer(x).numpy()
    for e in layer.experts:
        for n in EXPERT_PROJS:
            getattr(e, n).adapter_enabled = False
    base = layer(x).numpy()
    assert calls == [1, 1]
    for e in layer.experts:
        for n in EXPERT_PROJS:
            wrapped = getattr(e, n)
            setattr(e, n, wrapped.base_layer)
    plain = layer(x).numpy()
    np.testing.assert_allclose(base, plain, rtol=1e-6, atol=1e-7)
    assert np.abs(with_adapters - base).max() > 1e-3


def test_expert_targets_wrap_every_expert_of_a_qwen3_moe():
    model = load_pretrained(FIXTURES / "qwen3_moe")
    wrapped = apply_lora(model, _settings(["q_proj", "down_proj"]))
    # 3 layers' q_proj, layer 0's dense down_proj, 4 experts' down_proj in each of the 2 sparse layers
    assert len(wrapped) == 3 + 1 + 2 * 4
    assert any(w.endswith("layers.1.mlp.experts.3.down_proj") for w in wrapped), wrapped
    model.train()
    ids = paddle.to_tensor(np.random.default_rng(2).integers(0, 384, (2, 10)))
    total, count = model.loss_sum(ids, ids)
    (total / count).backward()
    trainable = [p for p in model.parameters() if not p.stop_gradient]
    assert len(trainable) == 2 * len(wrapped) and all(p.grad is not None for p in trainable)


HF_SCRIPT = r"""
import sys, numpy as np, torch, transformers, peft
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
if len(sys.argv) > 3:  # adapters (PEFT layout) onto the base
    model = peft.PeftModel.from_pretrained(model, sys.argv[3])
model.eval()
ids = torch.tensor(np.load(sys.argv[2]))
with torch.no_grad():
    np.save(sys.argv[2] + ".logits.npy", model(ids).logits.numpy())
"""


def _reference_logits(tmp_path, ids, *dirs):
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    if not ref or not Path(ref).exists():
        pytest.skip("BMTRAIN_REF_PYTHON (transformers + peft) is not set")
    np.save(tmp_path / "ids.npy", ids)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(
        [ref, "-c", HF_SCRIPT, str(dirs[0]), str(tmp_path / "ids.npy"), *map(str, dirs[1:])],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return np.load(tmp_path / "ids.npy.logits.npy")


def _expert_ckpt(tmp_path, name="qwen3_moe", targets=("q_proj", *EXPERT_PROJS)):
    """A LoRA checkpoint (the trainer's writer) with random adapters on ``targets`` of the ``name``
    fixture, and the adapted model's logits on some ids."""
    from bmtrain_cli.config.schema import Config
    from tests.unit.lora.conftest import lora_cfg, write_lora_ckpt

    model = load_pretrained(FIXTURES / name, kernels="reference")
    cfg = Config.model_validate(
        {
            "model_config": {"model_name_or_path": str(FIXTURES / name)},
            "train_config": lora_cfg(list(targets)).model_dump(),
        }
    )
    _, ckpt = write_lora_ckpt(model, cfg, tmp_path)
    model.eval()
    ids = np.random.default_rng(5).integers(0, 384, (2, 12))
    with paddle.no_grad():
        adapted = model(paddle.to_tensor(ids)).numpy()
        base = load_pretrained(FIXTURES / name, kernels="reference")(paddle.to_tensor(ids)).numpy()
    assert np.abs(adapted - base).max() > 1e-2  # the adapters change the output
    return ckpt, ids, adapted


@pytest.fixture
def expert_ckpt(tmp_path):
    return _expert_ckpt(tmp_path)


@pytest.mark.slow
def test_merged_export_of_expert_adapters_matches_in_transformers(expert_ckpt, tmp_path):
    """`bmtrain export --format hf` merges the expert adapters: ours reloads the export with the adapted
    model's logits, and so does transformers (reference venv)."""
    from typer.testing import CliRunner

    from bmtrain_cli.cli import app

    ckpt, ids, adapted = expert_ckpt
    out = tmp_path / "merged"
    res = CliRunner().invoke(app, ["export", "-c", str(ckpt), "-o", str(out), "--format", "hf"])
    assert res.exit_code == 0, res.output
    with paddle.no_grad():
        ours = load_pretrained(out, kernels="reference")(paddle.to_tensor(ids)).numpy()
    np.testing.assert_allclose(ours, adapted, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_reference_logits(tmp_path, ids, out), adapted, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, targets",
    [
        ("qwen3_moe", ("q_proj", "gate_proj", "up_proj", "down_proj")),  # and layer 0's dense MLP
        ("qwen3_moe", ("v_proj", "down_proj")),
        ("qwen3_moe", ("up_proj",)),
        ("ernie4_5_moe", ("q_proj", "gate_proj", "up_proj", "down_proj")),  # shared experts too
        ("mixtral", ("q_proj", "gate_proj", "up_proj", "down_proj")),
        ("glm4_moe", ("q_proj", "gate_proj", "up_proj", "down_proj")),
        ("deepseek_v3", ("kv_b_proj", "gate_proj", "up_proj", "down_proj")),
    ],
)
def test_no_merge_export_of_expert_adapters_loads_in_peft(name, targets, tmp_path):
    """`bmtrain export --no-merge` writes the expert adapters as PEFT adapts transformers 5.x's stacked
    experts (target_parameters, gate and up as one rank-2r adapter on gate_up_proj): ours reads them back,
    and PEFT loads them onto the base, with the adapted model's logits (reference venv)."""
    from typer.testing import CliRunner

    from bmtrain_cli.cli import app

    ckpt, ids, adapted = _expert_ckpt(tmp_path, name, targets)
    out = tmp_path / "adapters"
    res = CliRunner().invoke(app, ["export", "-c", str(ckpt), "-o", str(out), "--no-merge"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert "mlp.experts.down_proj" in cfg["target_parameters"] or "down_proj" not in targets
    assert not {"gate_proj", "up_proj", "down_proj"} & set(cfg["target_modules"] or [])
    from bmtrain_cli.lora import load_lora_checkpoint

    again = load_lora_checkpoint(out, kernels="reference")  # ours reads the stacked layout back
    with paddle.no_grad():
        np.testing.assert_allclose(again(paddle.to_tensor(ids)).numpy(), adapted, atol=1e-5, rtol=0)
    got = _reference_logits(tmp_path, ids, FIXTURES / name, out)
    np.testing.assert_allclose(got, adapted, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("targets", [("q_proj", *EXPERT_PROJS), ("q_proj", "k_proj", "v_proj", "o_proj")])
def test_checkpoint_of_moe_adapters_loads_in_peft(targets, tmp_path):
    """The trainer's checkpoint itself is PEFT's layout on a mixture of experts: with adapters on the
    experts, stacked as PEFT adapts transformers 5.x's experts (target_parameters); with attention only,
    plain target_modules. Ours resumes from it and PEFT loads it onto the base, both with the adapted
    model's logits (reference venv)."""
    ckpt, ids, adapted = _expert_ckpt(tmp_path, "qwen3_moe", targets)
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    experts = "down_proj" in targets
    assert set(cfg["target_modules"]) == set(targets) - set(EXPERT_PROJS)
    assert bool(cfg.get("target_parameters")) == experts
    from bmtrain_cli.lora import load_lora_checkpoint

    again = load_lora_checkpoint(ckpt, kernels="reference")
    with paddle.no_grad():
        np.testing.assert_allclose(again(paddle.to_tensor(ids)).numpy(), adapted, atol=1e-5, rtol=0)
    got = _reference_logits(tmp_path, ids, FIXTURES / "qwen3_moe", ckpt)
    np.testing.assert_allclose(got, adapted, atol=1e-5, rtol=0)
