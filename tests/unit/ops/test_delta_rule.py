"""The gated delta rule on our CPU kernel (ops/delta_rule.py) against the Paddle-op chunked rule of
ops/reference.py: outputs, final states and the gradients of q, k, v, g and beta, at odd lengths, one
token, a partial last chunk and the threaded path; float64 to 1e-10, float32 to float32 rounding; the
reference fallback for a given initial state."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.ops import reference
from bmtrain_cli.ops.delta_rule import gated_delta_rule


def _inputs(b: int, s: int, h: int, dk: int, dv: int, dtype: str, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, s, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = [
        rng.standard_normal((b, s, h, dk)) / np.sqrt(dk),
        k,
        rng.standard_normal((b, s, h, dv)),
        -rng.uniform(0.0, 3.0, (b, s, h)),
        rng.uniform(0.0, 1.0, (b, s, h)),
    ]
    return [paddle.to_tensor(a, dtype=dtype, stop_gradient=False) for a in arrays]


def _run(rule, tensors: list, weights: paddle.Tensor, final_weights: paddle.Tensor):
    out, final = rule(*tensors)
    loss = (out * weights).sum() + (final * final_weights).sum()
    return out.numpy(), final.numpy(), [g.numpy() for g in paddle.grad(loss, tensors)]


@pytest.mark.parametrize(
    "b,s,h,dk,dv,chunk",
    [
        (2, 1, 3, 8, 5, 4),
        (2, 37, 3, 8, 5, 8),
        (1, 64, 2, 16, 8, 64),
        (2, 70, 4, 16, 16, 64),
        (3, 300, 8, 32, 32, 64),
    ],
)
@pytest.mark.parametrize("dtype,tol", [("float64", 1e-10), ("float32", 2e-5)])
def test_kernel_equals_the_reference_forward_and_backward(ext, b, s, h, dk, dv, chunk, dtype, tol):
    tensors = _inputs(b, s, h, dk, dv, dtype)
    rng = np.random.default_rng(1)
    weights = paddle.to_tensor(rng.standard_normal((b, s, h, dv)), dtype=dtype)
    final_weights = paddle.to_tensor(rng.standard_normal((b, h, dk, dv)), dtype=dtype)
    want = _run(lambda *t: reference.gated_delta_rule(*t, chunk=chunk), tensors, weights, final_weights)
    got = _run(lambda *t: gated_delta_rule(*t, chunk=chunk), tensors, weights, final_weights)
    assert np.abs(got[0] - want[0]).max() <= tol * max(1.0, np.abs(want[0]).max())
    assert np.abs(got[1] - want[1]).max() <= tol * max(1.0, np.abs(want[1]).max())
    for name, g, w in zip(("q", "k", "v", "g", "beta"), got[2], want[2]):
        assert np.abs(g - w).max() <= tol * max(1.0, np.abs(w).max()), name


def test_without_gradients_and_with_a_given_state(ext):
    q, k, v, g, beta = _inputs(2, 19, 2, 8, 4, "float64", seed=3)
    with paddle.no_grad():
        out, final = gated_delta_rule(q, k, v, g, beta)
        want, want_final = reference.gated_delta_rule(q, k, v, g, beta)
    assert np.abs(out.numpy() - want.numpy()).max() < 1e-10
    assert np.abs(final.numpy() - want_final.numpy()).max() < 1e-10
    # a given state (generation continuing from the cache) runs the reference rule
    state = paddle.to_tensor(np.random.default_rng(4).standard_normal((2, 2, 8, 4)))
    out, final = gated_delta_rule(q, k, v, g, beta, state)
    want, want_final = reference.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    assert np.abs(out.numpy() - want.numpy()).max() < 1e-10
    assert np.abs(final.numpy() - want_final.numpy()).max() < 1e-10


def test_the_operator_refuses_mismatched_inputs(ext):
    q, k, v, g, beta = _inputs(1, 5, 2, 8, 4, "float32")
    with pytest.raises(Exception, match="beta"):
        ext.bmt_delta_rule_fwd(q, k, v, g, beta[:, :4], 64)
