"""train/cpu_adamw.CpuAdamW computes what paddle.optimizer.AdamW computes, with the same state."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.train.cpu_adamw import CpuAdamW

CLIP = 0.1


def _train(cls, steps=6, **kwargs):
    paddle.seed(0)
    # 256 x 160 = 40960 elements (the OpenMP path of the fused kernel, from 4Mi elements, is in
    # tests/unit/ops/test_fused_adamw.py)
    net = paddle.nn.Sequential(paddle.nn.Linear(16, 256), paddle.nn.Tanh(), paddle.nn.Linear(256, 160))
    decayed = {net[0].weight.name}
    sched = paddle.optimizer.lr.LinearWarmup(1e-2, 2, 0.0, 1e-2)
    opt = cls(
        learning_rate=sched,
        parameters=net.parameters(),
        weight_decay=0.1,
        apply_decay_param_fun=lambda name: name in decayed,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP),
        **kwargs,
    )
    x = paddle.to_tensor(np.random.RandomState(1).randn(8, 16).astype("float32"))
    norms = []
    for _ in range(steps):
        loss = (net(x) ** 2).mean()
        loss.backward()
        norms.append(float(paddle.sqrt(paddle.add_n([(p.grad**2).sum() for p in net.parameters()]))))
        opt.step()
        opt.clear_grad()
        sched.step()
    return net, opt, norms


@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "elementwise"])
def test_updates_and_state_equal_paddle_adamw(fused):
    """6 steps: warm-up schedule, weight decay on one weight only, a clip that fires, bias correction."""
    ref_net, ref_opt, _ = _train(paddle.optimizer.AdamW)
    net, opt, norms = _train(CpuAdamW, fused=fused)
    assert opt.fused is fused
    assert norms[0] > CLIP  # the clip fires: the update of a clipped gradient is compared too
    start, _, _ = _train(CpuAdamW, steps=0)
    # measured max |difference|: fused 1.9e-6, elementwise 1.3e-5 (on weights of ~0.1 moved by ~6e-2; the
    # largest differences sit where sqrt(v) is near epsilon, which amplifies one-ulp differences)
    atol = 2e-6 if fused else 2e-5
    for a, b, s in zip(ref_net.parameters(), net.parameters(), start.parameters()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=atol)
        assert np.abs(b.numpy() - s.numpy()).max() > 1e-3  # it trained
    ref_state, state = ref_opt.state_dict(), opt.state_dict()
    assert [k.split(".")[-1][-10:] for k in ref_state] == [k.split(".")[-1][-10:] for k in state]
    for (ka, a), (_, b) in zip(ref_state.items(), state.items()):
        if isinstance(a, paddle.Tensor):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7, err_msg=ka)


def test_fused_kernel_equals_the_elementwise_update():
    fused_net, _, _ = _train(CpuAdamW, fused=True)
    plain_net, _, _ = _train(CpuAdamW, fused=False)
    for a, b in zip(plain_net.parameters(), fused_net.parameters()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "elementwise"])
def test_weight_decay_follows_the_decay_rule(fused):
    """Only the decayed weight shrinks when the gradient is zero."""
    p = paddle.create_parameter([4, 4], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    q = paddle.create_parameter([4], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    opt = CpuAdamW(
        0.5, parameters=[p, q], weight_decay=0.1, apply_decay_param_fun=lambda n: n == p.name, fused=fused
    )
    (p.sum() * 0 + q.sum() * 0).backward()
    opt.step()
    assert float(p.mean()) == pytest.approx(1.0 - 0.5 * 0.1)
    assert float(q.mean()) == pytest.approx(1.0)


def test_build_optimizer_uses_it_on_the_cpu():
    from types import SimpleNamespace

    from bmtrain_cli.train.optim import build_optimizer

    cfg = SimpleNamespace(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0)
    opt = build_optimizer(paddle.nn.Linear(4, 4), cfg, 1e-3)
    assert isinstance(opt, CpuAdamW) == (paddle.get_device() == "cpu")
    if isinstance(opt, CpuAdamW):
        assert opt.fused  # the kernel builds here (a C++ compiler is part of the test environment)


def test_fallback_when_the_kernel_cannot_be_built(monkeypatch):
    from bmtrain_cli.ops import KernelFallbackWarning, fused_adamw
    from bmtrain_cli.ops.build import KernelBuildError
    from bmtrain_cli.train import cpu_adamw

    monkeypatch.setattr(fused_adamw, "unavailable_reason", lambda: "no C++ compiler found")
    monkeypatch.setattr(cpu_adamw, "_warned", False)
    lin = paddle.nn.Linear(4, 4)
    with pytest.warns(KernelFallbackWarning, match="no C\\+\\+ compiler found"):
        opt = CpuAdamW(1e-3, parameters=lin.parameters())
    assert not opt.fused
    with pytest.raises(KernelBuildError, match="fused CPU AdamW kernel is unavailable"):
        CpuAdamW(1e-3, parameters=lin.parameters(), fused=True)
