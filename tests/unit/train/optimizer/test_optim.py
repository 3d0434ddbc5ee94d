"""AdamW groups, fp32 clipping, non-finite handling, precision refusal."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import TrainConfig
from bmtrain_cli.errors import UserError
from bmtrain_cli.train.optimizer.adamw import (
    Precision,
    build_optimizer,
    check_precision_supported,
    clip_for_step,
    clip_grads_,
    decay_names,
    global_grad_norm,
)


class Tiny(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = paddle.nn.Linear(4, 4)
        self.input_layernorm = paddle.nn.LayerNorm(4)
        self.head = paddle.nn.Linear(4, 2, bias_attr=False)

    def forward(self, x):
        return self.head(self.input_layernorm(self.proj(x)))


def test_no_decay_on_norms_and_biases():
    paddle.seed(0)
    m = Tiny()
    names = {n for n, p in m.named_parameters() if p.name in decay_names(m)}
    assert names == {"proj.weight", "head.weight"}
    # With zero gradients only decoupled weight decay moves parameters: decayed ones shrink, others stay.
    opt = build_optimizer(m, TrainConfig(weight_decay=0.5, learning_rate=0.1), 0.1)
    before = {n: p.numpy().copy() for n, p in m.named_parameters()}
    for p in m.parameters():
        p.grad = paddle.zeros_like(p)
    (m(paddle.ones([1, 4])).sum() * 0).backward()
    opt.step()
    for n, p in m.named_parameters():
        changed = not np.allclose(before[n], p.numpy())
        assert changed == (n in ("proj.weight", "head.weight")), n


def test_global_norm_in_fp32_and_clip():
    paddle.seed(0)
    m = Tiny()
    m(paddle.randn([3, 4])).sum().backward()
    params = list(m.parameters())
    expected = np.sqrt(sum((p.grad.numpy().astype(np.float64) ** 2).sum() for p in params))
    norm = global_grad_norm(params)
    assert norm == pytest.approx(expected, rel=1e-5)
    factor = clip_grads_(params, expected / 4, norm)
    assert factor == pytest.approx(0.25, rel=1e-4)
    assert global_grad_norm(params) == pytest.approx(expected / 4, rel=1e-4)
    assert clip_grads_(params, 1e9, norm) == 1.0


def test_clip_for_step_folds_into_cpu_adamw_and_scales_for_the_others():
    from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW

    paddle.seed(0)
    m = Tiny()
    m(paddle.randn([3, 4])).sum().backward()
    params = list(m.parameters())
    grads = [p.grad.numpy().copy() for p in params]
    norm = global_grad_norm(params)
    ours = CpuAdamW(0.1, parameters=params)
    assert clip_for_step(ours, params, norm / 2, norm) == pytest.approx(0.5, rel=1e-4)
    assert ours._grad_scale == pytest.approx(0.5, rel=1e-4)  # taken by the next step
    for g, p in zip(grads, params):
        np.testing.assert_array_equal(p.grad.numpy(), g)  # the gradients are left as they are
    plain = paddle.optimizer.AdamW(0.1, parameters=params)
    assert clip_for_step(plain, params, norm / 2, norm) == pytest.approx(0.5, rel=1e-4)
    for g, p in zip(grads, params):
        np.testing.assert_allclose(p.grad.numpy(), g * 0.5, rtol=1e-4)


def test_non_finite_gradient_is_detected_and_skipped():
    paddle.seed(0)
    m = Tiny()
    opt = build_optimizer(m, TrainConfig(learning_rate=0.1), 0.1)
    m(paddle.to_tensor([[float("nan"), 1.0, 1.0, 1.0]])).sum().backward()
    norm = global_grad_norm(list(m.parameters()))
    assert not np.isfinite(norm)
    before = m.proj.weight.numpy().copy()
    prec = Precision("fp32")
    assert prec.step(opt, finite=False) is False
    np.testing.assert_array_equal(before, m.proj.weight.numpy())


def test_half_precision_refused_on_cpu_with_reason():
    check_precision_supported("fp32", has_gpu=False)
    for p in ("bf16", "fp16"):
        with pytest.raises(UserError, match="GPU build of Paddle"):
            check_precision_supported(p, has_gpu=False)


def test_o2_decorates_only_the_model_with_optimizer_offload(monkeypatch):
    """paddle.amp.decorate rejects the offload wrapper (it keeps fp32 masters on the host itself): with
    offload only the model is decorated; a stock optimizer is decorated with it (fp32 master weights)."""
    from bmtrain_cli.config.schema import TrainConfig
    from bmtrain_cli.train.optimizer.adamw import Precision, build_optimizer
    from bmtrain_cli.train.optimizer.offload import OffloadOptimizer

    calls = []

    def fake_decorate(models, optimizers=None, level="O1", dtype="float16", master_weight=None, **kw):
        calls.append(
            {
                "models": models,
                "optimizers": optimizers,
                "level": level,
                "dtype": dtype,
                "master_weight": master_weight,
            }
        )
        return models if optimizers is None else (models, optimizers)

    monkeypatch.setattr(paddle.amp, "decorate", fake_decorate)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    prec = Precision("bf16", "O2")
    offload = build_optimizer(model, TrainConfig(), 1e-3, multi_precision=True, offload=True)
    assert isinstance(offload, OffloadOptimizer)
    m, opt = prec.decorate(model, offload)
    assert m is model and opt is offload
    assert calls == [
        {"models": model, "optimizers": None, "level": "O2", "dtype": "bfloat16", "master_weight": False}
    ]

    calls.clear()
    plain = build_optimizer(model, TrainConfig(), 1e-3, multi_precision=True)
    m, opt = prec.decorate(model, plain)
    assert opt is plain and calls[0]["optimizers"] is plain and calls[0]["master_weight"] is True

    calls.clear()
    assert Precision("bf16", "O1").decorate(model, plain) == (model, plain)  # O1: no cast, no masters
    assert Precision("fp32").decorate(model, offload) == (model, offload)
    assert calls == []
