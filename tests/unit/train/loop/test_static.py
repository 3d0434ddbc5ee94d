"""train_config.to_static: the compiled training step gives the dygraph losses; unsupported layouts are
refused with a clear message."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from bmtrain_cli.config import load_config

CONFIG = """
model_config:
  family: llama
  hidden_size: 64
  intermediate_size: 128
  num_hidden_layers: 2
  num_attention_heads: 4
  max_seq_len: 32
  kernels: {kernels}
train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: 4
  micro_batch_size: 4
  global_batch_size: 8
  batching: {batching}
  learning_rate: 3.0e-3
  warmup_steps: 1
  logging_steps: 1
  save_steps: 100
  num_workers: 0
  to_static: {static}
  gradient_checkpointing: {recompute}
"""


def _data(tmp: Path) -> Path:
    path = tmp / "train.jsonl"
    rows = [{"input": f"add {i} and {i + 3}", "output": str(2 * i + 3)} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _run(
    tmp: Path,
    name: str,
    *,
    static: bool,
    batching: str = "packed",
    recompute: bool = False,
    kernels: str = "reference",
):
    from bmtrain_cli.train.run import load_recipe

    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        CONFIG.format(
            data=_data(tmp),
            out=tmp / name,
            batching=batching,
            static=str(static).lower(),
            recompute=str(recompute).lower(),
            kernels=kernels,
        ),
        encoding="utf-8",
    )
    parts, state = load_recipe("sft").setup(load_config(str(cfg), mode="train"), stream=io.StringIO())
    losses = []
    load_recipe("sft").train(parts, state, lambda p, s, out: losses.append((out.loss, out.grad_norm)))
    return parts, losses


@pytest.mark.parametrize(
    "batching,recompute", [("packed", False), ("max_length", True)], ids=["packed", "max_length-recompute"]
)
def test_to_static_losses_equal_dygraph(tmp_path, batching, recompute):
    _, eager = _run(tmp_path, "eager", static=False, batching=batching, recompute=recompute)
    parts, static = _run(tmp_path, "static", static=True, batching=batching, recompute=recompute)
    from bmtrain_cli.models.decoder import LossSum

    assert isinstance(parts.optim.loss_fn, LossSum)
    assert "StaticFunction" in type(parts.optim.loss_fn.forward).__name__  # compiled, not the eager forward
    assert len(eager) == len(static) == 4
    for (le, ge), (ls, gs) in zip(eager, static):
        assert abs(le - ls) < 1e-5 * max(1.0, abs(le))
        assert abs(ge - gs) < 1e-4 * max(1.0, abs(ge))
    assert eager[-1][0] < eager[0][0]  # it trains


@pytest.mark.parametrize("kernels", ["custom", "auto"])
def test_to_static_custom_kernels_equal_dygraph_reference(tmp_path, kernels, monkeypatch):
    """Our C++ ops (with their grad ops) inside the compiled step: the reference dygraph losses. auto runs
    in its static order (our kernels) here; its per-op timing (a mix) is tested in tests/unit/ops."""
    from bmtrain_cli.ops.build import KernelBuildError, load_extension

    monkeypatch.setenv("BMTRAIN_KERNEL_CHOICE", "static")

    try:
        load_extension()
    except KernelBuildError as exc:
        pytest.skip(f"custom kernels cannot be built here: {exc}")
    _, eager = _run(tmp_path, "eager", static=False, batching="max_length")
    parts, static = _run(tmp_path, "static", static=True, batching="max_length", kernels=kernels)
    assert "StaticFunction" in type(parts.optim.loss_fn.forward).__name__
    assert set(parts.model.raw.ops.sources.values()) == {"custom"}
    assert len(eager) == len(static) == 4
    for (le, ge), (ls, gs) in zip(eager, static):
        assert abs(le - ls) < 1e-5 * max(1.0, abs(le))
        assert abs(ge - gs) < 1e-4 * max(1.0, abs(ge))
    assert eager[-1][0] < eager[0][0]


def test_to_static_layouts_are_refused_by_the_config_checks():
    from bmtrain_cli.config.checks import check_config
    from bmtrain_cli.config.schema import Config

    base = {"model_config": {"family": "llama"}, "train_config": {"to_static": True}}
    for key in ("pipeline_parallel", "tensor_parallel"):
        cfg = Config.model_validate({**base, "parallel_config": {key: 2}})
        problems = [p for p in check_config(cfg) if p.severity == "error"]
        assert [p.path for p in problems] == ["train_config.to_static"]
        assert key in problems[0].message
    assert not [p for p in check_config(Config.model_validate(base)) if p.severity == "error"]
