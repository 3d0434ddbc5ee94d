"""A mixture of experts with a quantised base (QLoRA on qwen3_moe): every expert's projections are
quantised while the checkpoint is read (the router stays full precision), and the model computes what the
unquantised model computes on the dequantised weights: the loss and the gradient that reaches the
embedding through the experts' input gradients, to fp32 round-off. The quantised experts run as grouped
calls (quant/experts.py), three per sparse layer, forward and backward."""

from __future__ import annotations

import numpy as np
import paddle

from bmtrain_cli.config.quant_schema import QuantizationConfig
from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.models import build, load_pretrained, save_pretrained
from bmtrain_cli.models.arch import arch_from_model_config
from bmtrain_cli.models.moe import Router
from bmtrain_cli.parallel.full_weights import dequantized_weights
from bmtrain_cli.quant import experts as quant_experts
from bmtrain_cli.quant.formats import quantize
from bmtrain_cli.quant.layer import quantized_layers

ARCH = arch_from_model_config(
    ModelConfig(
        family="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
)


def _loss_and_embedding_grad(model, ids):
    model.model.embed_tokens.weight.stop_gradient = False
    loss, count = model.loss_sum(ids, ids)
    (loss / count).backward()
    return float(loss / count), model.model.embed_tokens.weight.grad.numpy()


def test_qwen3_moe_experts_quantised_while_loaded_equal_the_dequantised_model(tmp_path, monkeypatch):
    paddle.seed(0)
    save_pretrained(build(ARCH, kernels="reference"), str(tmp_path))
    q = QuantizationConfig(method="nf4", block_size=32)
    quantised = load_pretrained(str(tmp_path), kernels="custom", quantization=q)
    layers = dict(quantized_layers(quantised))
    experts = [n for n in layers if ".mlp.experts." in n]
    assert len(experts) == 2 * 4 * 3 and len(layers) == 2 * (4 * 3 + 4)
    assert all(isinstance(quantised.model.layers[i].mlp.gate, Router) for i in range(2))  # not quantised
    # the codes are those of the checkpoint's tensor, quantised on its own
    whole = load_pretrained(str(tmp_path), kernels="custom")
    w = whole.model.layers[1].mlp.experts[3].down_proj.weight.numpy().T
    want = quantize(w, "nf4", 32)
    got = layers["model.layers.1.mlp.experts.3.down_proj"]
    np.testing.assert_array_equal(got.codes.numpy(), want.codes)
    np.testing.assert_array_equal(got.scales.numpy(), want.scales)
    # the unquantised model (grouped expert GEMM) on the dequantised weights computes the same
    state = {n: p.numpy() for n, p in quantised.state_dict().items()}
    state.update(dequantized_weights(quantised))
    whole.set_state_dict({n: paddle.to_tensor(v) for n, v in state.items()})
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 256, (2, 24)))
    impls = []
    grouped = quant_experts.experts_linear
    monkeypatch.setattr(quant_experts, "experts_linear", lambda *a: impls.append(a[3]) or grouped(*a))
    loss_q, grad_q = _loss_and_embedding_grad(quantised, ids)
    assert impls == ["custom"] * (2 * 3)
    loss_w, grad_w = _loss_and_embedding_grad(whole, ids)
    np.testing.assert_allclose(loss_q, loss_w, rtol=1e-6)
    np.testing.assert_allclose(grad_q, grad_w, rtol=1e-4, atol=1e-7)
    assert np.abs(grad_q).max() > 1e-4


def test_a_rank_reads_and_quantises_only_the_experts_it_holds(tmp_path, monkeypatch):
    """Expert parallel: load_pretrained's ``held_experts`` (here experts 2 and 3 of 4) reads and quantises
    those experts' projections alone, with the codes of the whole load; the others are never read, and
    stand as shape-only HeldElsewhere layers that LoRA wraps like quantised ones, so that every rank holds
    the same parameters until shard_experts keeps its own experts."""
    from types import SimpleNamespace

    from bmtrain_cli.lora.inject import apply_lora
    from bmtrain_cli.models.safetensors_io import SafetensorsFile
    from bmtrain_cli.quant.layer import HeldElsewhere

    paddle.seed(0)
    save_pretrained(build(ARCH, kernels="reference"), str(tmp_path))
    q = QuantizationConfig(method="nf4", block_size=32)
    whole = load_pretrained(str(tmp_path), kernels="reference", quantization=q)
    read, get = [], SafetensorsFile.get
    monkeypatch.setattr(SafetensorsFile, "get", lambda self, name: read.append(name) or get(self, name))
    mine = load_pretrained(
        str(tmp_path), kernels="reference", quantization=q, held_experts=lambda n: range(2, 4)
    )
    others = (".experts.0.", ".experts.1.")
    assert any(".experts.2." in n for n in read) and not any(o in n for n in read for o in others)
    codes = {n: m.codes.numpy() for n, m in quantized_layers(whole)}
    held = dict(quantized_layers(mine))
    assert set(held) == {n for n in codes if not any(o in n + "." for o in others)}
    for name, layer in held.items():
        np.testing.assert_array_equal(layer.codes.numpy(), codes[name])
    elsewhere = [n for n, m in mine.named_sublayers() if isinstance(m, HeldElsewhere)]
    assert len(elsewhere) == 2 * 2 * 3 and all(any(o in n + "." for o in others) for n in elsewhere)
    lora = SimpleNamespace(
        lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules="all-linear", seed=0
    )
    apply_lora(whole, lora)
    apply_lora(mine, lora)
    shapes = [(n, list(p.shape)) for n, p in whole.named_parameters()]
    assert [(n, list(p.shape)) for n, p in mine.named_parameters()] == shapes
    wanted = dict(whole.named_parameters())  # each adapter drawn from its name: the whole model's
    for n, p in mine.named_parameters():
        np.testing.assert_array_equal(p.numpy(), wanted[n].numpy())
    for layer in mine.sublayers():
        if hasattr(layer, "shard_experts"):
            layer.shard_experts(range(2, 4), lambda rows, counts, run: run(rows, counts))
    assert not any(isinstance(m, HeldElsewhere) for m in mine.sublayers())
    assert len(dict(quantized_layers(mine))) == len(held)
