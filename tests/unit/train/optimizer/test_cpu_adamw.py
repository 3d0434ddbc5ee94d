"""train/optimizer/cpu_adamw.CpuAdamW computes what paddle.optimizer.AdamW computes, with the same state."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.train.optimizer.cpu_adamw import CpuAdamW

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
    # measured max |difference|: fused 1.9e-6 to 7.6e-6 by CPU model (-march=native contracts differently),
    # elementwise 1.3e-5 (on weights of ~0.1 moved by ~6e-2; the largest differences sit where sqrt(v) is
    # near epsilon, which amplifies one-ulp differences)
    atol = 2e-5
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

    from bmtrain_cli.train.optimizer.adamw import build_optimizer

    cfg = SimpleNamespace(adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.0)
    opt = build_optimizer(paddle.nn.Linear(4, 4), cfg, 1e-3)
    assert isinstance(opt, CpuAdamW) == (paddle.get_device() == "cpu")
    if isinstance(opt, CpuAdamW):
        assert opt.fused  # the kernel builds here (a C++ compiler is part of the test environment)


def test_fallback_when_the_kernel_cannot_be_built(monkeypatch):
    from bmtrain_cli import ops
    from bmtrain_cli.ops import KernelFallbackWarning, fused_adamw
    from bmtrain_cli.ops.build import KernelBuildError
    from bmtrain_cli.train.optimizer import cpu_adamw

    monkeypatch.setattr(fused_adamw, "unavailable_reason", lambda: "no C++ compiler found")
    monkeypatch.setattr(cpu_adamw, "_warned", False)
    monkeypatch.setattr(ops, "_fallback_reasons", set())
    lin = paddle.nn.Linear(4, 4)
    with pytest.warns(KernelFallbackWarning, match="no C\\+\\+ compiler found"):
        opt = CpuAdamW(1e-3, parameters=lin.parameters())
    assert not opt.fused
    with pytest.raises(KernelBuildError, match="fused CPU AdamW kernel is unavailable"):
        CpuAdamW(1e-3, parameters=lin.parameters(), fused=True)


MAX_NORM = 0.05


def _net(dtype):
    paddle.seed(0)
    half_lr = paddle.ParamAttr(learning_rate=0.5)  # a parameter-specific learning rate (optimize_attr)
    net = paddle.nn.Sequential(
        paddle.nn.Linear(16, 256, weight_attr=half_lr), paddle.nn.Tanh(), paddle.nn.Linear(256, 160)
    )
    return net.to(dtype=dtype)


def _train_trainer_clip(cls, dtype="float32", steps=5, fold=True, **kwargs):
    """The trainer's order (train/loop/step.py): global norm, clip (folded into a CpuAdamW's step by
    clip_for_step, or clip_grads_), step; warm-up, decay on one weight only, a half-lr weight."""
    from bmtrain_cli.train.optimizer.adamw import clip_for_step, clip_grads_, global_grad_norm

    net = _net(dtype)
    decayed = {net[0].weight.name, net[2].weight.name}
    sched = paddle.optimizer.lr.LinearWarmup(1e-2, 2, 0.0, 1e-2)
    params = net.parameters()
    opt = cls(
        learning_rate=sched, parameters=params, weight_decay=0.1, apply_decay_param_fun=lambda n: n in decayed,
        **kwargs,
    )  # fmt: skip
    x = paddle.to_tensor(np.random.RandomState(1).randn(8, 16).astype(dtype))
    factors = []
    for _ in range(steps):
        (net(x) ** 2).mean().backward()
        norm = global_grad_norm(params)
        clip = clip_for_step if fold else (lambda _o, p, m, n: clip_grads_(p, m, n))
        factors.append(clip(opt, params, MAX_NORM, norm))
        opt.step()
        opt.clear_grad()
        sched.step()
    return net, opt, factors


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_kernel", "elementwise"])
def test_folded_clip_equals_clipping_the_gradients(dtype, fused):
    """CpuAdamW with the clip factor folded into its step == CpuAdamW and paddle's AdamW after clip_grads_."""
    net, opt, factors = _train_trainer_clip(CpuAdamW, dtype, fused=fused)
    assert all(f < 0.9 for f in factors)  # the clip fires in every step
    clipped, _, _ = _train_trainer_clip(CpuAdamW, dtype, fold=False, fused=fused)
    ref, ref_opt, _ = _train_trainer_clip(paddle.optimizer.AdamW, dtype)
    start = _net(dtype)
    # measured max |difference| to paddle's AdamW: fp32 fused 6e-8 to 1e-6 by CPU model (elementwise 2e-6:
    # its own rounding), fp64 4e-12 (paddle's fp64 kernel takes some scalars in fp32)
    tol = 1e-5 if dtype == "float32" else 1e-10
    for a, b, c, s in zip(net.parameters(), clipped.parameters(), ref.parameters(), start.parameters()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-7 if dtype == "float32" else 1e-15)
        np.testing.assert_allclose(a.numpy(), c.numpy(), rtol=0, atol=tol)
        assert np.abs(a.numpy() - s.numpy()).max() > 1e-3  # it trained
    for (k, a), (_, b) in zip(ref_opt.state_dict().items(), opt.state_dict().items()):
        if isinstance(a, paddle.Tensor):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-8, err_msg=k)


def test_the_grad_scale_lasts_one_step():
    lin = paddle.nn.Linear(4, 4)
    opt = CpuAdamW(0.1, parameters=lin.parameters())
    opt.set_grad_scale(0.5)
    opt.clear_grad()
    assert opt._grad_scale == 1.0
    opt.set_grad_scale(0.5)
    lin(paddle.ones([1, 4])).sum().backward()
    opt.step()
    assert opt._grad_scale == 1.0
    with pytest.raises(ValueError, match="finite and >= 0"):
        opt.set_grad_scale(float("inf"))


def test_param_groups_and_lagging_beta_powers_equal_paddle_adamw():
    """Parameter groups (own weight decay and lr scale), and a parameter without a gradient in some steps:
    its beta powers lag behind the others', and the fused call uses each parameter's own."""

    def run(cls):
        paddle.seed(0)
        a, b = paddle.nn.Linear(8, 32), paddle.nn.Linear(32, 4)
        groups = [
            {"params": a.parameters(), "weight_decay": 0.2},
            {"params": b.parameters(), "weight_decay": 0.0, "learning_rate": 0.5},
        ]
        opt = cls(learning_rate=1e-2, parameters=groups, weight_decay=0.1)
        x = paddle.to_tensor(np.random.RandomState(2).randn(4, 8).astype("float32"))
        for step in range(5):
            h = a(x)
            out = b(h) if step % 2 == 0 else h * b.weight.sum() * 0 + h  # b.bias: no gradient
            (out**2).mean().backward()
            opt.step()
            opt.clear_grad(set_to_zero=False)
        return [p.numpy() for p in a.parameters() + b.parameters()], opt.state_dict()

    ref, ref_state = run(paddle.optimizer.AdamW)
    got, state = run(CpuAdamW)
    for x, y in zip(ref, got):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)
    pows = {k: float(v.numpy().reshape(-1)[0]) for k, v in state.items() if "beta1_pow" in k}
    assert len(set(round(v, 8) for v in pows.values())) > 1  # the powers did diverge
    assert len(ref_state) == len(state)
    for (k, v), w in zip(ref_state.items(), state.values()):  # same order (the names differ by model)
        if isinstance(v, paddle.Tensor):
            np.testing.assert_allclose(w.numpy(), v.numpy(), rtol=1e-5, atol=1e-8, err_msg=k)


def test_resumes_from_paddle_adamw_state():
    """The state (accumulator names, beta powers) is Paddle's: a state saved before continues the same."""
    net, ref_opt, _ = _train_trainer_clip(paddle.optimizer.AdamW, steps=3)
    state = {k: v.clone() if isinstance(v, paddle.Tensor) else v for k, v in ref_opt.state_dict().items()}
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    x = paddle.to_tensor(np.random.RandomState(3).randn(8, 16).astype("float32"))

    def more(opt, model):
        for _ in range(3):
            (model(x) ** 2).mean().backward()
            opt.step()
            opt.clear_grad()
        return [p.numpy() for p in model.parameters()]

    ref = more(ref_opt, net)
    net.set_state_dict(weights)  # the same parameters (names) again, a fresh optimizer from the state
    with paddle.utils.unique_name.guard():  # the accumulator names of a fresh process (..._moment1_0)
        decayed = {net[0].weight.name, net[2].weight.name}
        opt = CpuAdamW(
            learning_rate=1e-2, parameters=net.parameters(), weight_decay=0.1,
            apply_decay_param_fun=lambda n: n in decayed,
        )  # fmt: skip
        opt.set_state_dict(state)
        got = more(opt, net)  # the accumulators are made in the first step
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
