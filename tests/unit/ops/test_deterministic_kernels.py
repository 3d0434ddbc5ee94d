"""Our CPU kernels' reductions give the same bits for any thread count (issue 28: bit-reproducible runs).

The gradient norm's sum of squares, the RMSNorm weight gradient (summed over rows) and the attention K/V
gradients (summed over query chunks when batch x kv heads is small) each add partial sums; their
partitioning depends on the shape only and the partials are added in a fixed order. A child process per
OMP_NUM_THREADS computes all three on the threaded path (above kernels/cpu/parallel.h's threshold) and
prints a digest of the result bytes; the digests must be equal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import hashlib
import numpy as np
import paddle
from bmtrain_cli.ops import custom, grad_norm
from bmtrain_cli.ops.fused_attention import fused_attention

rng = np.random.default_rng(0)
h = hashlib.sha256()
def t(*shape):
    x = paddle.to_tensor(rng.standard_normal(shape).astype("float32"))
    x.stop_gradient = False
    return x

# sum of squares over 5 Mi elements in 80 chunks (threaded above 4 Mi)
total, _ = grad_norm.sum_squares([t(5 << 20), t(3, 1001)])
h.update(total.numpy().tobytes())
# RMSNorm backward on 2048 x 2304 rows (threaded), weight gradient summed over the rows
x, w = t(2048, 2304), t(2304)
(custom.rms_norm(x, w, 1e-6) * t(2048, 2304)).sum().backward()
h.update(x.grad.numpy().tobytes()); h.update(w.grad.numpy().tobytes())
# attention with one (batch, kv head) pair: its query blocks run in chunks, K/V gradients summed
q, k, v = t(1, 512, 4, 64), t(1, 512, 1, 64), t(1, 512, 1, 64)
out = fused_attention(q, k, v)
(out * t(1, 512, 4, 64)).sum().backward()
for g in (out, q.grad, k.grad, v.grad):
    h.update(g.numpy().tobytes())
print(h.hexdigest())
"""


def _digest(threads: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_reductions_give_the_same_bits_for_any_thread_count(ext):
    digests = {n: _digest(n) for n in (1, 2, 3)}
    assert len(set(digests.values())) == 1, digests
