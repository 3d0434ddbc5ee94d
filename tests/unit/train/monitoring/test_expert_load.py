"""Monitoring of a mixture of experts' routers (train/monitoring/expert_load.py): per-layer tokens per expert over a
step, logged to metrics.jsonl and TensorBoard by `bmtrain train`, and a collapsed router (one expert taking
more than 90% of a layer's tokens) warned of in the log, once per layer."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import numpy as np
import paddle
import pytest

from bmtrain_cli.models.moe import SparseMoE
from bmtrain_cli.ops import select
from bmtrain_cli.train.monitoring.expert_load import add_loads, collapsed_layers, load_metrics
from bmtrain_cli.train.monitoring.metrics import MetricsWriter, read_metrics


def test_load_metrics_sum_the_micro_batches_and_find_a_collapse():
    class Layer:
        def __init__(self, counts):
            self.mlp = type("M", (), {"last_counts": counts})()

    model = type("Model", (), {"layers": [Layer([]), Layer([4, 0, 3, 1]), Layer([2, 2, 2, 2])]})()
    loads = add_loads(add_loads(None, model), model)  # two micro-batches
    assert sorted(loads) == [1, 2] and loads[1].tolist() == [8, 0, 6, 2]
    m = load_metrics(loads, top_k=2)
    # layer 1: 16 (token, expert) pairs of top 2 = 8 tokens, all of them through expert 0
    assert m["expert_load/max/layer_1"] == 8 and m["expert_load/mean/layer_1"] == 4
    assert m["expert_load/top_share/layer_1"] == 1.0
    assert m["expert_load/top_share/layer_2"] == pytest.approx(4 / 8)
    assert collapsed_layers(m) == ["layer_1"]
    # top 2 of 2 experts: every expert takes every token, no collapse
    assert collapsed_layers(load_metrics({0: np.array([5, 5])}, top_k=2)) == []
    assert collapsed_layers(load_metrics({0: np.array([10, 0, 1])}, top_k=1)) == ["layer_0"]
    assert collapsed_layers(load_metrics({0: np.array([9, 1, 0])}, top_k=1)) == []  # 90% is not over


def test_a_router_sending_every_token_to_one_expert_is_found():
    from tests.unit.models.test_moe import _fresh_arch

    arch = replace(_fresh_arch(), num_experts=4, num_experts_per_tok=1)
    layer = SparseMoE(arch, select("reference", device="cpu"))
    x = paddle.abs(paddle.randn([2, 8, arch.hidden_size]))
    layer(x)
    model = type("Model", (), {"layers": [type("L", (), {"mlp": layer})()]})()
    assert sum(layer.last_counts) == 16
    with paddle.no_grad():
        w = np.zeros(layer.gate.weight.shape, "float32")
        w[:, 2] = 10.0  # positive inputs: expert 2 wins every token
        layer.gate.weight.set_value(paddle.to_tensor(w))
    layer(x)
    m = load_metrics(add_loads(None, model), arch.num_experts_per_tok)
    assert layer.last_counts == [0, 0, 16, 0] and m["expert_load/top_share/layer_0"] == 1.0
    assert collapsed_layers(m) == ["layer_0"]


def test_the_writer_logs_the_load_and_warns_once_per_layer(tmp_path):
    out = io.StringIO()
    w = MetricsWriter(tmp_path, total_steps=3, logging_steps=1, stream=out, tty=False)
    for step in (1, 2, 3):
        load = {0: np.array([3, 3, 2, 0]), 1: np.array([8, 0, 0, 0] if step > 1 else [2, 2, 2, 2])}
        w.log_train(step, {"loss": 1.0, "lr": 1e-3, **load_metrics(load, top_k=1)})
    w.close()
    text = out.getvalue()
    assert text.count("warning") == 1 and "layer 1 sent 100.0% of its tokens to one expert" in text
    recs = read_metrics(tmp_path / "metrics.jsonl")
    events = [r for r in recs if r.get("event") == "router_collapse"]
    assert [(e["step"], e["layer"]) for e in events] == [(2, "layer_1")]
    assert [r["expert_load/max/layer_0"] for r in recs if "loss" in r] == [3.0, 3.0, 3.0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "logs"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/expert_load/top_share/layer_1")] == [0.25, 1.0, 1.0]
    assert "train/expert_load/mean/layer_0" in acc.Tags()["scalars"]


@pytest.mark.slow
def test_bmtrain_train_logs_the_expert_load_of_a_fresh_qwen3_moe(tmp_path):
    """`bmtrain train` on a fresh qwen3_moe (2 sparse layers, 4 experts, top 2): every step's record has
    each layer's load, consistent with itself (mean = routed pairs / experts, max >= mean)."""
    from typer.testing import CliRunner

    from bmtrain_cli.cli import app
    from tests.tiny import model_yaml

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        model_yaml(max_seq_len=24, kv_heads=None)
        + f"""
train_config:
  demo_data: arithmetic
  output_dir: {tmp_path / "out"}
  max_steps: 2
  micro_batch_size: 4
  global_batch_size: 8
  warmup_steps: 0
  logging_steps: 1
  save_steps: 2
  eval_steps: 2
  num_workers: 0
""",
        encoding="utf-8",
    )
    sets = ["model_config.family=qwen3_moe", "model_config.num_experts=4"]
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r and "event" not in r]
    assert len(train) == 2
    for r in train:
        for i in (0, 1):
            top, mean = r[f"expert_load/max/layer_{i}"], r[f"expert_load/mean/layer_{i}"]
            tokens = mean * 4 / 2
            assert tokens == int(tokens) and tokens >= 2 * 4 * 2  # 2 micro-batches of 4 rows
            assert mean <= top <= tokens and r[f"expert_load/top_share/layer_{i}"] == pytest.approx(
                top / tokens
            )
