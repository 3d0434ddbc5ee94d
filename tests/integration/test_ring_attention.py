"""Ring attention (parallel/ring_attention.py) over 2 and 4 processes equals attention over the whole
sequence on one process: each rank's output and its q/k/v gradients, for plain causal rows and for packed
rows with padding, with grouped-query heads (4 query heads, 2 KV heads), in one query block per chunk or
in blocks of 7 tokens (uneven: the last block of a chunk is shorter), and with the fused CPU kernel per
chunk pair (parallel/ring_pairs.py). The ulysses mode (parallel/ulysses.py:
an all-to-all of heads and sequence around the blocked attention) likewise, over 2 ranks (1 KV head each)
and 4 (8 query heads, 4 KV heads: 2 and 1 a rank)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "cp_scripts" / "ring_worker.py"
sys.path.insert(0, str(WORKER.parent))


def _whole(seq: int, packed: bool, heads=(4, 2)):
    """Output and gradients of the same loss over the whole sequence, by the blocked reference."""
    import paddle
    from ring_worker import problem

    from bmtrain_cli.models.attention import blocked_attention

    q, k, v, w, seg = problem(seq, packed, *heads)
    ts = [paddle.to_tensor(x, stop_gradient=False) for x in (q, k, v)]
    out = blocked_attention(*ts, None if seg is None else paddle.to_tensor(seg), block=16)
    (out * paddle.to_tensor(w)).sum().backward()
    return out.numpy(), [t.grad.numpy() for t in ts]


CASES = [
    ("ring", 2, False, 512),
    ("ring", 2, True, 7),
    ("ring", 4, True, 512),
    ("ring", 4, True, 7),
    ("fused", 2, True, 512),
    ("fused", 4, False, 512),
    ("ulysses", 2, False, 16),
    ("ulysses", 2, True, 16),
    ("ulysses", 4, True, 16),
]


@pytest.mark.parametrize("mode,nproc,packed,block", CASES)
def test_context_attention_equals_whole_sequence(tmp_path, mode, nproc, packed, block):
    seq = 80 if nproc == 2 else 96  # 2N chunks of 20 / 12 tokens: packed boundaries fall inside chunks
    heads = (8, 4) if mode == "ulysses" and nproc == 4 else (4, 2)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc)]
    cmd += ["--log_dir", str(tmp_path / "log"), str(WORKER), "--out", str(tmp_path / "r"), "--seq", str(seq)]
    cmd += ["--block", str(block), "--heads", *map(str, heads)]
    cmd += (["--packed"] if packed else []) + (["--ulysses"] if mode == "ulysses" else [])
    cmd += ["--fused"] if mode == "fused" else []
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert res.returncode == 0, logs
    out, grads = _whole(seq, packed, heads)
    seen = np.zeros(seq, dtype=bool)
    for r in range(nproc):
        got = np.load(tmp_path / f"r.{r}.npz")
        idx = got["idx"]
        seen[idx] = True
        np.testing.assert_allclose(got["out"], out[:, idx], rtol=1e-5, atol=1e-5)
        for name, g in zip(("dq", "dk", "dv"), grads):
            np.testing.assert_allclose(got[name], g[:, idx], rtol=1e-4, atol=1e-5, err_msg=f"rank {r} {name}")
    assert seen.all()  # the ranks hold every token once between them
