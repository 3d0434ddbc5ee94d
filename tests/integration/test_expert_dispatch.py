"""The expert-parallel dispatch (parallel/expert_parallel.py: all-gathered counts, the all-to-all of rows
and its reverse, on gloo through cpu_compat.all_to_all_rows) over 2 and 4 processes equals the experts run
in one process: each rank's outputs and its rows' gradients, and each held expert's weight gradients (the
sum over every rank's rows), with uneven counts, an expert no row reaches and a rank that sends nothing.
Decoding on a model whose experts are split (models/generate.py) runs every step on every rank and samples
what one process samples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).parent / "ep_scripts" / "dispatch_worker.py"
sys.path.insert(0, str(WORKER.parent))


def _one_process(world: int, empty_rank: int):
    """Per rank: the outputs and the rows' gradients; the experts' weight gradients summed over ranks."""
    import paddle
    from dispatch_worker import EXPERTS, problem

    from bmtrain_cli.ops.moe_experts import reference_experts, swiglu_expert

    counts, rows, loss_w, weights = problem(world, empty_rank)
    whole = [[paddle.to_tensor(w[e], stop_gradient=False) for e in range(EXPERTS)] for w in weights]
    experts = [swiglu_expert(g, u, d) for g, u, d in zip(*whole)]
    outs, dxs = [], []
    for r in range(world):
        x = paddle.to_tensor(rows[r], stop_gradient=False)
        out = reference_experts(x, [int(c) for c in counts[r]], experts)
        (out * paddle.to_tensor(loss_w[r])).sum().backward()
        outs.append(out.numpy())
        dxs.append(x.grad.numpy())
    grads = {f"d{n}": np.stack([t.grad.numpy() for t in ts]) for n, ts in zip(("gate", "up", "down"), whole)}
    return outs, dxs, grads


@pytest.mark.parametrize("nproc,empty_rank", [(2, -1), (2, 1), (4, 2)])
def test_dispatch_equals_the_experts_in_one_process(tmp_path, nproc, empty_rank):
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc)]
    cmd += ["--log_dir", str(tmp_path / "log"), str(WORKER), "--out", str(tmp_path / "r")]
    res = subprocess.run(cmd + ["--empty-rank", str(empty_rank)], capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert res.returncode == 0, logs
    outs, dxs, grads = _one_process(nproc, empty_rank)
    held = []
    for r in range(nproc):
        got = np.load(tmp_path / f"r.{r}.npz")
        np.testing.assert_allclose(got["out"], outs[r], rtol=1e-5, atol=1e-6, err_msg=f"rank {r} out")
        np.testing.assert_allclose(got["dx"], dxs[r], rtol=1e-5, atol=1e-6, err_msg=f"rank {r} dx")
        owned = list(got["owned"])
        held += owned
        for name, g in grads.items():
            np.testing.assert_allclose(got[name], g[owned], rtol=1e-5, atol=1e-6, err_msg=f"rank {r} {name}")
    assert sorted(held) == list(range(grads["dgate"].shape[0]))  # every expert on exactly one rank
    assert np.all(grads["dgate"][1] == 0)  # the expert no row reaches


def test_decoding_steps_in_step_over_the_group_and_samples_what_one_process_samples(tmp_path):
    """Rank 0 samples 2 tokens, rank 1 6: rank 0 keeps running (dropped) forwards until rank 1 is done, so
    both run 6, and each rank's tokens are what the whole model samples for its prompts in one process."""
    from generate_worker import MAX_NEW, model, sample

    worker = WORKER.parent / "generate_worker.py"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2"]
    cmd += ["--log_dir", str(tmp_path / "log"), str(worker), "--out", str(tmp_path / "r")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))
    assert res.returncode == 0, logs
    whole = model()
    for r in range(2):
        got = json.loads((tmp_path / f"r.{r}.json").read_text())
        assert got["tokens"] == sample(whole, r), r
        assert all(len(t) == MAX_NEW[r] for t in got["tokens"])
        assert got["forwards"] == max(MAX_NEW), got
