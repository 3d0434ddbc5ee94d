"""What of mixed precision Paddle's CPU build really runs, measured rather than assumed: it is why training
refuses bf16/fp16 on a CPU (config/checks.py, train/optimizer/adamw.check_precision_supported) and why the
half-precision path is listed as GPU-only in docs/training.md. If a Paddle release starts running these on
CPU, this test fails and the refusal should be revisited."""

from __future__ import annotations

import warnings

import paddle
import pytest

from bmtrain_cli.train.optimizer.adamw import Precision

pytestmark = pytest.mark.skipif(paddle.is_compiled_with_cuda(), reason="facts of Paddle's CPU build")


def test_amp_is_inert_on_the_cpu_place():
    model = paddle.nn.Linear(4, 4)
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), multi_precision=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # the real GradScaler our fp16 path uses switches itself off: loss scaling does not happen
        prec = Precision("fp16", loss_scale=1024.0)
        assert prec.scaler is not None and prec.scaler._enable is False
        loss = model(paddle.ones([2, 4])).sum()
        assert float(prec.scaler.scale(loss)) == float(loss)
        # O2 decoration keeps fp32 weights, autocast keeps fp32 matmuls
        decorated, _ = Precision("bf16", "O2").decorate(model, opt)
        assert all(p.dtype == paddle.float32 for p in decorated.parameters())
        with Precision("bf16", "O1").autocast():
            assert model(paddle.ones([2, 4])).dtype == paddle.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_kernels_are_missing_on_cpu(dtype):
    x = paddle.ones([2, 4]).astype(dtype)  # casts exist: half-precision storage works
    assert x.dtype == getattr(paddle, dtype)
    missing = {
        "matmul": lambda t: paddle.matmul(t, t, transpose_y=True),
        "add": lambda t: t + t,
        "softmax": paddle.nn.functional.softmax,
        "silu": paddle.nn.functional.silu,
        "mean": lambda t: t.mean(-1),
    }
    for name, op in missing.items():
        with pytest.raises((NotImplementedError, RuntimeError, ValueError), match="kernel"):
            op(x)
            pytest.fail(f"{name} ran in {dtype} on CPU")
