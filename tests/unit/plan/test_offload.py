"""Optimizer offload gives the same training as the plain optimizer, and resumes across the two."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.train.optimizer.offload import OffloadOptimizer


class _Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.emb = paddle.nn.Embedding(50, 16)
        self.fc1 = paddle.nn.Linear(16, 32)
        self.norm = paddle.nn.LayerNorm(32)
        self.fc2 = paddle.nn.Linear(32, 50, bias_attr=False)
        self.unused = paddle.nn.Linear(4, 4)  # never gets a gradient

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.fc2(paddle.nn.functional.gelu(self.norm(self.fc1(self.emb(ids)))))


def _net(seed: int = 0) -> _Net:
    paddle.seed(seed)
    return _Net()


def _batches(n: int) -> list:
    rng = np.random.default_rng(1)
    return [paddle.to_tensor(rng.integers(0, 50, size=(4, 7)), dtype="int64") for _ in range(n)]


def _kwargs(model: _Net, lr: paddle.optimizer.lr.LRScheduler) -> dict:
    decay = {p.name for n, p in model.named_parameters() if "norm" not in n and len(p.shape) > 1}
    return dict(
        learning_rate=lr,
        beta1=0.9,
        beta2=0.95,
        epsilon=1e-8,
        weight_decay=0.1,
        apply_decay_param_fun=lambda name: name in decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5),
    )


def _train(model: _Net, opt, lr, batches) -> list:
    losses = []
    for ids in batches:
        logits = model(ids)
        loss = paddle.nn.functional.cross_entropy(logits.reshape([-1, 50]), ids.reshape([-1])).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        lr.step()
        losses.append(float(loss))
    return losses


def _weights(model: _Net) -> dict:
    return {n: p.numpy().copy() for n, p in model.named_parameters()}


def _renamed(state: dict, old: _Net, new: _Net) -> dict:
    """The state dict as a fresh process would write it: parameter names are per-process counters, so
    a model built again in this process has other names than the one that wrote the state."""
    pairs = sorted(
        ((a.name, b.name) for a, b in zip(old.parameters(), new.parameters())), key=lambda ab: -len(ab[0])
    )
    out = {}
    for key, value in state.items():
        for a, b in pairs:
            if key.startswith(a + "_"):
                key = b + key[len(a) :]
                break
        out[key] = value
    return out


def _make(model: _Net, offload: bool):
    lr = paddle.optimizer.lr.CosineAnnealingDecay(learning_rate=0.05, T_max=10)
    kw = _kwargs(model, lr)
    if offload:
        return OffloadOptimizer(model.parameters(), paddle.optimizer.AdamW, **kw), lr
    return paddle.optimizer.AdamW(parameters=model.parameters(), **kw), lr


def test_offload_matches_plain_adamw_exactly() -> None:
    batches = _batches(6)
    plain_model = _net()
    plain_opt, plain_lr = _make(plain_model, offload=False)
    plain_losses = _train(plain_model, plain_opt, plain_lr, batches)

    off_model = _net()
    off_opt, off_lr = _make(off_model, offload=True)
    off_losses = _train(off_model, off_opt, off_lr, batches)

    assert plain_losses == off_losses
    assert plain_losses[-1] < plain_losses[0]
    a, b = _weights(plain_model), _weights(off_model)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # the weights really moved, and the unused layer (no gradient) did not
    assert not np.array_equal(a["fc1.weight"], _weights(_net())["fc1.weight"])
    np.testing.assert_array_equal(a["unused.weight"], _weights(_net())["unused.weight"])
    # the optimizer state lives in the host copies, not in the model's parameters
    assert off_opt.host_bytes() >= 3 * sum(int(p.numel()) * 4 for p in off_opt._parameter_list[:-2])
    assert off_opt.get_lr() == pytest.approx(plain_opt.get_lr())


def test_state_dict_resumes_across_offload_and_plain() -> None:
    batches = _batches(6)
    ref_model = _net()
    ref_opt, ref_lr = _make(ref_model, offload=False)
    _train(ref_model, ref_opt, ref_lr, batches)

    # 3 steps with offload, then resume the remaining 3 with the plain optimizer from its state dict
    model = _net()
    opt, lr = _make(model, offload=True)
    _train(model, opt, lr, batches[:3])
    state = opt.state_dict()
    assert any(k.startswith(model.fc1.weight.name + "_moment1") for k in state)
    weights = _weights(model)

    model2 = _net(seed=5)
    model2.set_state_dict({n: paddle.to_tensor(w) for n, w in weights.items()})
    opt2, lr2 = _make(model2, offload=False)
    opt2.set_state_dict(_renamed(state, model, model2))
    _train(model2, opt2, lr2, batches[3:])
    for name, w in _weights(ref_model).items():
        np.testing.assert_array_equal(w, _weights(model2)[name], err_msg=name)

    # and the other way: plain for 3 steps, offload for the rest
    model3 = _net()
    opt3, lr3 = _make(model3, offload=False)
    _train(model3, opt3, lr3, batches[:3])
    state3 = opt3.state_dict()
    model4 = _net(seed=7)
    model4.set_state_dict({n: paddle.to_tensor(w) for n, w in _weights(model3).items()})
    opt4, lr4 = _make(model4, offload=True)
    opt4.set_state_dict(_renamed(state3, model3, model4))
    _train(model4, opt4, lr4, batches[3:])
    for name, w in _weights(ref_model).items():
        np.testing.assert_array_equal(w, _weights(model4)[name], err_msg=name)


@pytest.mark.parametrize("master_on_host", [True, False])
def test_low_precision_weights_keep_fp32_masters(master_on_host: bool) -> None:
    """bf16 weights: the update happens on the fp32 master, the weight is its rounding."""
    paddle.seed(3)
    w32 = paddle.create_parameter([8, 8], "float32")
    w16 = paddle.create_parameter(
        [8, 8], paddle.bfloat16, default_initializer=paddle.nn.initializer.Constant(0.0)
    )
    w16.set_value(w32.astype("bfloat16"))
    start = w16.astype("float32").numpy()
    opt = OffloadOptimizer([w16], paddle.optimizer.AdamW, master_on_host=master_on_host, learning_rate=1e-3)
    ref = paddle.create_parameter([8, 8], "float32")
    ref.set_value(paddle.to_tensor(start))
    ref_opt = paddle.optimizer.AdamW(parameters=[ref], learning_rate=1e-3)
    rng = np.random.default_rng(0)
    for _ in range(4):
        g = rng.standard_normal((8, 8)).astype("float32")
        w16.grad = paddle.to_tensor(g).astype("bfloat16")
        ref.grad = paddle.to_tensor(g).astype("bfloat16").astype("float32")
        opt.step()
        opt.clear_grad()
        ref_opt.step()
        ref_opt.clear_grad()
    master = opt.state_dict()["master_weights"][w16.name].numpy()
    np.testing.assert_allclose(master, ref.numpy(), rtol=0, atol=1e-7)
    # updates of 1e-3 are below bf16 resolution for most entries: only the master keeps them
    assert not np.array_equal(master, start)
    np.testing.assert_array_equal(
        w16.astype("float32").numpy(), ref.astype("bfloat16").astype("float32").numpy()
    )
    assert (opt._device_master[0] is not None) == (not master_on_host)


def test_no_trainable_parameters_is_an_error() -> None:
    p = paddle.create_parameter([2], "float32")
    p.stop_gradient = True
    with pytest.raises(ValueError, match="no trainable"):
        OffloadOptimizer([p], learning_rate=0.1)
