"""ops/choice.resolve: one kernel choice for the run (ops.select) and the memory plan; the record of
``auto``'s measured choices (keyed by machine and shapes; a corrupt file is ignored with a warning)."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest

import bmtrain_cli.ops as ops
from bmtrain_cli.ops import choice, measure, reference
from bmtrain_cli.plan.activations import kernel_choice, layer_activations
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.workload import Layout, Workload

TINY = choice.OpShapes(hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, vocab=64, tied=True)
CPU_LAYERS = choice.layers("auto", "cpu", choice.OP_NAMES)


@pytest.fixture
def record(tmp_path, monkeypatch):
    path = tmp_path / "choices.json"
    monkeypatch.setenv("BMTRAIN_KERNEL_CHOICES", str(path))
    monkeypatch.delenv("BMTRAIN_KERNEL_CHOICE", raising=False)
    monkeypatch.delenv("PADDLE_TRAINERS_NUM", raising=False)
    monkeypatch.setattr(ops, "_cache", {})
    return path


class Timer:
    """A stand-in for the timing (what it returns is a choice the static order would not make)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, static):
        self.calls += 1
        return {"rms_norm": ("reference", {"custom": 2.0, "reference": 1.0})}


def test_static_order_per_mode_and_device() -> None:
    assert set(choice.static_sources(choice.layers("reference", "cpu", choice.OP_NAMES)).values()) == {
        "reference"
    }
    paddle_cpu = choice.static_sources(choice.layers("paddle", "cpu", ()))
    assert paddle_cpu["swiglu"] == "paddle" and paddle_cpu["rms_norm"] == "reference"
    assert choice.static_sources(choice.layers("paddle", "gpu:0", ()))["rms_norm"] == "paddle"
    no_compiler = choice.static_sources(choice.layers("auto", "cpu", ()))
    assert no_compiler == paddle_cpu
    assert set(choice.static_sources(CPU_LAYERS).values()) == {"custom"}
    with pytest.raises(ValueError):
        choice.layers("fast", "cpu", ())


def test_measured_choice_is_recorded_and_read_back(record) -> None:
    timer = Timer()
    run = choice.resolve("auto", "cpu", TINY, choice.OP_NAMES, measure=timer)
    assert run.origin == "measured" and run.sources["rms_norm"] == "reference" and timer.calls == 1
    assert run.sources["swiglu"] == "custom"  # ops the timing kept: the static order
    again = choice.resolve("auto", "cpu", TINY, choice.OP_NAMES, measure=timer)
    assert again.origin == "recorded" and again.sources == run.sources and timer.calls == 1
    planned = choice.resolve("auto", "cpu", TINY, choice.OP_NAMES)  # the planner: never times
    assert planned.origin == "recorded" and planned.sources == run.sources
    # another shape, another kernel build or another set of candidates: a new key, timed again
    other = choice.resolve("auto", "cpu", replace(TINY, ffn=64), choice.OP_NAMES, measure=timer)
    assert other.origin == "measured" and timer.calls == 2
    fewer = choice.resolve("auto", "cpu", TINY, (), measure=timer)  # no kernels built
    assert fewer.origin == "measured" and timer.calls == 3
    assert len(json.loads(record.read_text())) == 3


def test_planner_without_a_record_counts_the_static_order(record) -> None:
    planned = choice.resolve("auto", "cpu", TINY, choice.OP_NAMES)
    assert planned.origin == "unmeasured" and planned.sources == choice.static_sources(CPU_LAYERS)
    assert not record.exists()


@pytest.mark.parametrize("env,processes", [({"BMTRAIN_KERNEL_CHOICE": "static"}, 1), ({}, 2)])
def test_no_timing_and_no_record_where_auto_does_not_measure(record, monkeypatch, env, processes) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    timer = Timer()
    for device in ("cpu", "gpu:0"):
        got = choice.resolve("auto", device, TINY, choice.OP_NAMES, processes, measure=timer)
        assert got.origin == "static" and set(got.sources.values()) == {"custom"}
    assert timer.calls == 0 and not record.exists()


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", json.dumps({"k": "v"})])
def test_a_corrupt_or_foreign_record_is_ignored(record, text) -> None:
    record.write_text(text)
    timer = Timer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = choice.resolve("auto", "cpu", TINY, choice.OP_NAMES, measure=timer)
    assert got.origin == "measured" and timer.calls == 1
    bad_file = text != json.dumps({"k": "v"})  # a valid file with an unrelated entry: no warning
    assert any(issubclass(w.category, choice.KernelChoiceWarning) for w in caught) == bad_file
    assert choice.resolve("auto", "cpu", TINY, choice.OP_NAMES).origin == "recorded"  # rewritten whole


def test_a_recorded_source_the_candidates_lack_is_not_used(record) -> None:
    key = choice.record_key("cpu", TINY, CPU_LAYERS)
    record.write_text(json.dumps({key: {"rms_norm": "paddle"}}))  # Paddle has no CPU RMSNorm
    assert choice.resolve("auto", "cpu", TINY, choice.OP_NAMES).origin == "unmeasured"


def test_the_run_and_the_plan_resolve_the_same_choice(ext, record, monkeypatch, repo_root) -> None:
    """select() (what the model runs) records the timed choice; the plan of the same model reads it and
    counts the reference RMSNorm's extra activations."""
    from bmtrain_cli.config import load_config

    config = load_config(str(repo_root / "configs/quickstart.yaml")).config
    w = Workload.from_config(config, read_data=False)
    w = replace(w, arch=replace(w.arch, vocab_size=256))
    cpu, layout = get_device("cpu"), Layout(micro_batch=2)
    before = kernel_choice(w, cpu, layout)
    assert before.origin == "unmeasured" and before.sources["rms_norm"] == "custom"
    static = layer_activations(w, cpu, layout, 1, "none")[0][0]

    def timed(shapes, candidates, default=None):  # the reference RMSNorm "wins"
        return {"rms_norm": ("reference", {"custom": 2.0, "reference": 1.0})}

    monkeypatch.setattr(measure, "choose", timed)
    opset = ops.select("auto", device="cpu", shapes=ops.OpShapes.of(w.arch))
    assert opset.rms_norm is reference.rms_norm and opset.timings["rms_norm"]["reference"] == 1.0
    after = kernel_choice(w, cpu, layout)
    assert after.origin == "recorded" and after.sources == opset.sources
    kept = layer_activations(w, cpu, layout, 1, "none")[0][0]
    tokens = 2 * w.seq_len
    assert kept - static == 2 * w.arch.hidden_size * 4 * tokens  # the two norms' fp32 inputs
    # a layout of two ranks does not time: the plan of it counts the static order
    assert kernel_choice(w, cpu, Layout(micro_batch=2, dp=2)).sources == before.sources


def test_timing_leaves_the_random_stream_as_it_was(ext, record) -> None:
    """A run that times the ops and one that reads the record draw the same initial weights."""
    import paddle

    paddle.seed(7)
    opset = ops.select("auto", device="cpu", shapes=TINY)
    assert opset.timings  # it timed
    timed = paddle.randn([4]).numpy()
    paddle.seed(7)
    ops._cache.clear()
    assert ops.select("auto", device="cpu", shapes=TINY).timings == {}  # read from the record
    assert (paddle.randn([4]).numpy() == timed).all()
