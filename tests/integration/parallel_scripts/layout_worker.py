"""Worker for test_parallel_layouts.py: train a tiny decoder for 3 AdamW steps under the layout given on
the command line and write the per-step losses (and the gathered whole weights) as JSON/npz.

Run under `python -m paddle.distributed.launch`; with --single it runs the single-process reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import paddle

from bmtrain_cli.config.schema import Config
from bmtrain_cli.models.decoder import CausalLM
from bmtrain_cli.models.layers import PlainFactory
from tests.tiny import ARCH

GLOBAL_BATCH, MICRO, SEQ, STEPS = 8, 2, 32, 3


def data():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, ARCH.vocab_size, (GLOBAL_BATCH, SEQ))
    labels = ids.copy()
    labels[:, :4] = -100
    mask = np.ones_like(ids)
    mask[1, 20:] = 0
    mask[2, 16:] = 2
    pos = np.tile(np.arange(SEQ), (GLOBAL_BATCH, 1))
    pos[2, 16:] = np.arange(SEQ - 16)
    return ids, labels, mask, pos


def initial_weights():
    paddle.seed(7)
    m = CausalLM(ARCH, PlainFactory(), kernels="reference")
    m.init_weights()
    return {k: v.numpy() for k, v in m.state_dict().items()}


def optimizer(params):
    return paddle.optimizer.AdamW(learning_rate=1e-2, parameters=params, weight_decay=0.0)


def run_single(out: Path) -> None:
    ids, labels, mask, pos = data()
    model = CausalLM(ARCH, PlainFactory(), kernels="reference")
    model.set_state_dict({k: paddle.to_tensor(v) for k, v in initial_weights().items()})
    opt = optimizer(model.parameters())
    losses = []
    for _ in range(STEPS):
        parts = []
        for i in range(0, GLOBAL_BATCH, MICRO):
            sl = slice(i, i + MICRO)
            t = [paddle.to_tensor(a[sl]) for a in (ids, labels, mask, pos)]
            parts.append(model.loss_sum(*t))
        count = float(sum(float(c) for _, c in parts))
        loss = sum(s for s, _ in parts) / count
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    out.write_text(json.dumps({"losses": losses}))
    np.savez(str(out) + ".npz", **{k: v.numpy() for k, v in model.state_dict().items()})


def run_parallel(out: Path, par: dict, save_dir: str = "", load_dir: str = "") -> None:
    from bmtrain_cli.parallel.topology import init_parallel

    cfg = Config.model_validate(
        {
            "parallel_config": par,
            "train_config": {
                "output_dir": str(out.parent / "ranks"),
                "micro_batch_size": MICRO,
                "global_batch_size": GLOBAL_BATCH,
            },
            "model_config": {"max_seq_len": SEQ},
        }
    )
    ctx = init_parallel(cfg)
    ids, labels, mask, pos = data()
    if load_dir:
        from bmtrain_cli.models import load_pretrained

        model = load_pretrained(load_dir, kernels="reference", factory=ctx.wrapping.factory)
        model.train()
    else:
        model = CausalLM(ARCH, ctx.wrapping.factory, kernels="reference")
        ctx.wrapping.load_full_state_dict(model, initial_weights())
    model = ctx.wrapping.wrap_model(model)
    opt = ctx.wrapping.wrap_optimizer(optimizer(model.parameters()))
    per_rank = GLOBAL_BATCH // ctx.data_world
    rows = range(ctx.data_rank * per_rank, (ctx.data_rank + 1) * per_rank)
    micro = [
        {
            "input_ids": ids[i : i + MICRO],
            "labels": labels[i : i + MICRO],
            "attention_mask": mask[i : i + MICRO],
            "position_ids": pos[i : i + MICRO],
        }
        for i in rows[::MICRO]
    ]
    losses = []
    for _ in range(STEPS):
        if ctx.pp_degree > 1:
            total, count = ctx.wrapping.pipeline_step(model, micro, opt)
        else:
            parts = [
                model.loss_sum(
                    *[
                        paddle.to_tensor(b[k])
                        for k in ("input_ids", "labels", "attention_mask", "position_ids")
                    ]
                )
                for b in micro
            ]
            count = ctx.collectives.all_reduce_sum(float(sum(float(c) for _, c in parts)))
            for s, _ in parts:
                (s / count).backward()
            total = ctx.collectives.all_reduce_sum(float(sum(float(s) for s, _ in parts)))
            opt.step()
            opt.clear_grad()
        losses.append(total / count)
    full = ctx.wrapping.full_state_dict(model)
    plain = ctx.wrapping.gather_full_model(
        model, kernels="reference"
    )  # collective; a whole single-process model
    plain_ok = all(np.array_equal(v.numpy(), full[k]) for k, v in plain.state_dict().items())
    if save_dir:
        writer = ctx.wrapping.checkpoint_weights_writer(model)
        if ctx.rank == 0:
            if writer is None:
                from bmtrain_cli.models import save_pretrained

                save_pretrained(model, save_dir)
            else:
                writer(model, save_dir)
        ctx.collectives.barrier()
    if ctx.rank == 0:
        out.write_text(
            json.dumps(
                {
                    "losses": losses,
                    "compression": ctx.wrapping.compression_stats,
                    "pipeline": ctx.pipeline_info,
                    "gathered_model_ok": plain_ok,
                }
            )
        )
        np.savez(str(out) + ".npz", **full)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--par", default="{}")
    ap.add_argument("--save_dir", default="")
    ap.add_argument("--load_dir", default="")
    a = ap.parse_args()
    if a.single:
        run_single(Path(a.out))
    else:
        run_parallel(Path(a.out), json.loads(a.par), a.save_dir, a.load_dir)
