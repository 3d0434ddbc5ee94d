"""LoRA on a fused projection held as its parts (lora/split_parts.py, Qwen3.5's in_proj_qkv under tensor
parallel): the parts' adapters compute the fused adapter's function, A is one parameter, and the
checkpoint arrays go to the fused PEFT names and back. (Under tp2 through `bmtrain run`:
tests/integration/test_parallel_matrix.py, qwen3_5-hybrid-lora.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.lora import apply_lora, lora_layers
from bmtrain_cli.lora.merge import adapter_arrays, load_adapter_weights
from bmtrain_cli.lora.split_parts import fuse_adapter_arrays, split_adapter_arrays

H, SIZES = 6, (4, 4, 5)
ARCH = SimpleNamespace(fused_qkv=False, fused_gate_up=False, linear_attention=object())
CFG = SimpleNamespace(
    lora_rank=2, lora_alpha=4, lora_dropout=0.0, lora_target_modules=["in_proj_qkv"], seed=3
)


class _Mixer(nn.Layer):
    """A fused in_proj_qkv, or its three parts as tensor parallel holds them (one rank here)."""

    def __init__(self, parts: bool) -> None:
        super().__init__()
        self.parts = parts
        if parts:
            for p, n in zip("qkv", SIZES):
                setattr(self, f"in_proj_{p}", nn.Linear(H, n, bias_attr=False))
        else:
            self.in_proj_qkv = nn.Linear(H, sum(SIZES), bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.parts:
            return paddle.concat([getattr(self, f"in_proj_{p}")(x) for p in "qkv"], axis=-1)
        return self.in_proj_qkv(x)


def _model(parts: bool) -> nn.Layer:
    model = nn.Layer()
    model.linear_attn = _Mixer(parts)
    model.arch = ARCH
    return model


def test_the_parts_adapters_are_the_fused_adapter():
    fused, split = _model(False), _model(True)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((H, sum(SIZES))).astype(np.float32)
    fused.linear_attn.in_proj_qkv.weight.set_value(paddle.to_tensor(w))
    for p, piece in zip("qkv", np.split(w, np.cumsum(SIZES)[:-1], axis=1)):
        getattr(split.linear_attn, f"in_proj_{p}").weight.set_value(paddle.to_tensor(piece))
    assert apply_lora(fused, CFG) == apply_lora(split, CFG) == ["linear_attn.in_proj_qkv"]
    # one A shared by the three parts, drawn as the fused layer's (the same seed and name)
    parts = [getattr(split.linear_attn, f"in_proj_{p}") for p in "qkv"]
    assert parts[0].lora_A is parts[1].lora_A is parts[2].lora_A
    np.testing.assert_array_equal(
        parts[0].lora_A.weight.numpy(), fused.linear_attn.in_proj_qkv.lora_A.weight.numpy()
    )
    assert len([p for p in split.parameters() if not p.stop_gradient]) == 4  # A once, three B
    b = rng.standard_normal((2, sum(SIZES))).astype(np.float32)
    load_adapter_weights(fused, {**adapter_arrays(fused), "linear_attn.in_proj_qkv.lora_B.weight": b})
    whole = fuse_adapter_arrays(adapter_arrays(fused), ARCH)
    load_adapter_weights(split, whole)  # the fused arrays onto the parts
    x = paddle.to_tensor(rng.standard_normal((3, H)).astype(np.float32))
    got, want = split.linear_attn(x).numpy(), fused.linear_attn(x).numpy()
    assert np.abs(want - x.numpy() @ w).max() > 0.1  # the adapter counts
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and back to the fused names, as a checkpoint holds them
    back = fuse_adapter_arrays(adapter_arrays(split), ARCH)
    assert set(back) == {"linear_attn.in_proj_qkv.lora_A.weight", "linear_attn.in_proj_qkv.lora_B.weight"}
    for name, value in whole.items():
        np.testing.assert_array_equal(back[name], value)
    assert set(split_adapter_arrays(split, back)) == set(adapter_arrays(split))
    assert len(lora_layers(split)) == 3
