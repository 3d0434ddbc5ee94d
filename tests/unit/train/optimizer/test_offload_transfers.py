"""Optimizer offload's transfers: pinned + asynchronous on a GPU place, plain blocking copies on a CPU."""

from __future__ import annotations

import numpy as np
import paddle

from bmtrain_cli.train.optimizer.offload import OffloadOptimizer, Transfers, uses_pinned_staging


class _GpuPlace:
    def is_gpu_place(self) -> bool:
        return True


def test_pinned_staging_only_for_gpu_places():
    assert uses_pinned_staging(_GpuPlace())
    assert not uses_pinned_staging(paddle.CPUPlace())
    assert not uses_pinned_staging(object())


def test_cpu_transfers_are_copies():
    moves = Transfers(paddle.CPUPlace())
    x = paddle.to_tensor(np.arange(6, dtype="float32"))
    get = moves.to_host(x, paddle.CPUPlace())
    back = moves.to_device(x, paddle.CPUPlace())
    moves.wait()
    x.set_value(paddle.zeros([6]))
    np.testing.assert_array_equal(get().numpy(), np.arange(6))
    np.testing.assert_array_equal(back.numpy(), np.arange(6))


def test_offload_step_matches_the_plain_optimizer():
    paddle.seed(3)
    a = paddle.nn.Linear(8, 4)
    b = paddle.nn.Linear(8, 4)
    b.set_state_dict(a.state_dict())
    plain = paddle.optimizer.AdamW(learning_rate=0.1, parameters=a.parameters())
    off = OffloadOptimizer(b.parameters(), paddle.optimizer.AdamW, learning_rate=0.1)
    x = paddle.randn([5, 8])
    for _ in range(3):
        for m, opt in ((a, plain), (b, off)):
            m(x).square().mean().backward()
            opt.step()
            opt.clear_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6, atol=1e-6)
