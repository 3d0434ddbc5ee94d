"""train/cpu_adamw.CpuAdamW computes what paddle.optimizer.AdamW computes, with the same state."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.train.cpu_adamw import CpuAdamW

CLIP = 0.5


def _train(cls, steps=6):
    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.Tanh(), paddle.nn.Linear(32, 4))
    decayed = {net[0].weight.name}
    sched = paddle.optimizer.lr.LinearWarmup(1e-2, 2, 0.0, 1e-2)
    opt = cls(
        learning_rate=sched,
        parameters=net.parameters(),
        weight_decay=0.1,
        apply_decay_param_fun=lambda name: name in decayed,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP),
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


def test_updates_and_state_equal_paddle_adamw():
    ref_net, ref_opt, _ = _train(paddle.optimizer.AdamW)
    net, opt, norms = _train(CpuAdamW)
    assert norms[0] > CLIP  # the clip fires: the update of a clipped gradient is compared too
    start, _, _ = _train(CpuAdamW, steps=0)
    for a, b, s in zip(ref_net.parameters(), net.parameters(), start.parameters()):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
        assert np.abs(b.numpy() - s.numpy()).max() > 1e-3  # it trained
    ref_state, state = ref_opt.state_dict(), opt.state_dict()
    assert [k.split(".")[-1][-10:] for k in ref_state] == [k.split(".")[-1][-10:] for k in state]
    for (ka, a), (_, b) in zip(ref_state.items(), state.items()):
        if isinstance(a, paddle.Tensor):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-7, err_msg=ka)


def test_weight_decay_follows_the_decay_rule():
    """Only the decayed weight shrinks when the gradient is zero."""
    p = paddle.create_parameter([4, 4], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    q = paddle.create_parameter([4], "float32", default_initializer=paddle.nn.initializer.Constant(1.0))
    opt = CpuAdamW(0.5, parameters=[p, q], weight_decay=0.1, apply_decay_param_fun=lambda n: n == p.name)
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
