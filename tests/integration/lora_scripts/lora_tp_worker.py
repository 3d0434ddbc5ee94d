"""Worker for test_lora_parallel.py: LoRA (all-linear, rank 4) on a tiny decoder, 3 AdamW steps over the
same 8 rows, single process (--single) or under the parallel layout given by --par (run it with
`python -m paddle.distributed.launch`). Writes the per-step losses (JSON) and the whole adapters (npz)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import paddle

from bmtrain_cli.config.schema import Config
from bmtrain_cli.lora.inject import apply_lora
from bmtrain_cli.lora.merge import adapter_arrays, load_adapter_weights
from bmtrain_cli.models.decoder import CausalLM
from bmtrain_cli.models.layers import PlainFactory
from bmtrain_cli.train.lora_run import whole_adapter_arrays
from tests.tiny import ARCH

LORA = SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules="all-linear")
ROWS, MICRO, SEQ, STEPS = 8, 2, 32, 3


def data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ARCH.vocab_size, (ROWS, SEQ))
    labels = ids.copy()
    labels[:, :4] = -100
    mask = np.ones_like(ids)
    mask[1, 20:] = 0
    mask[2, 16:] = 2  # a packed row
    pos = np.tile(np.arange(SEQ), (ROWS, 1))
    pos[2, 16:] = np.arange(SEQ - 16)
    return ids, labels, mask, pos


def initial_weights():
    """Whole base weights and whole non-zero adapters (so every adapter gets a gradient at step 1)."""
    paddle.seed(7)
    m = CausalLM(ARCH, PlainFactory(), kernels="reference")
    m.init_weights()
    base = {k: v.numpy() for k, v in m.state_dict().items()}
    apply_lora(m, LORA)
    rng = np.random.default_rng(11)
    adapters = {k: rng.normal(0, 0.05, v.shape).astype("float32") for k, v in adapter_arrays(m).items()}
    return base, adapters


def train(model, opt, micro, ctx=None):
    losses = []
    for _ in range(STEPS):
        parts = [model.loss_sum(*[paddle.to_tensor(b[k]) for k in range(4)]) for b in micro]
        count = float(sum(float(c) for _, c in parts))
        total = float(sum(float(s) for s, _ in parts))
        if ctx is not None:
            count, total = ctx.collectives.all_reduce_sum(count), ctx.collectives.all_reduce_sum(total)
        for s, _ in parts:
            (s / count).backward()
        opt.step()
        opt.clear_grad()
        losses.append(total / count)
    return losses


def micro_batches(rows):
    arrays = data()
    return [tuple(a[i : i + MICRO] for a in arrays) for i in rows[::MICRO]]


def run(out: Path, par: dict) -> None:
    base, adapters = initial_weights()
    ctx = None
    if par:
        from bmtrain_cli.parallel.topology import init_parallel

        cfg = Config.model_validate(
            {
                "parallel_config": par,
                "train_config": {"output_dir": str(out.parent / "ranks"), "micro_batch_size": MICRO},
                "model_config": {"max_seq_len": SEQ},
            }
        )
        ctx = init_parallel(cfg)
        model = CausalLM(ARCH, ctx.wrapping.factory, kernels="reference")
        ctx.wrapping.load_full_state_dict(model, base)
    else:
        model = CausalLM(ARCH, PlainFactory(), kernels="reference")
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in base.items()})
    apply_lora(model, LORA)
    load_adapter_weights(model, adapters)
    model.train()
    if ctx is not None:
        model = ctx.wrapping.wrap_model(model)
    params = [p for p in model.parameters() if not p.stop_gradient]
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=params, weight_decay=0.0)
    if ctx is not None:
        opt = ctx.wrapping.wrap_optimizer(opt)
    data_rank, data_world = (ctx.data_rank, ctx.data_world) if ctx is not None else (0, 1)
    per = ROWS // data_world
    losses = train(model, opt, micro_batches(range(data_rank * per, (data_rank + 1) * per)), ctx)
    whole = whole_adapter_arrays(model, ctx)
    if ctx is None or ctx.rank == 0:
        n_trainable = sum(int(p.numel()) for p in params)
        out.write_text(json.dumps({"losses": losses, "local_trainable": n_trainable}))
        np.savez(str(out) + ".npz", **whole)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--par", default="{}")
    a = ap.parse_args()
    run(Path(a.out), {} if a.single else json.loads(a.par))
