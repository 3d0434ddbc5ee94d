"""select(): which implementation each mode picks, the single fallback warning, and custom's clear error."""

from __future__ import annotations

import warnings

import paddle
import pytest

import bmtrain_cli.ops as ops
from bmtrain_cli.errors import UserError
from bmtrain_cli.ops import build, custom, measure, reference


@pytest.fixture
def broken_build(monkeypatch, tmp_path):
    """Pretend the kernel sources are missing: a fresh process that cannot build."""
    monkeypatch.setattr(build, "KERNELS_DIR", tmp_path / "no-kernels")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(ops, "_cache", {})
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.setattr(ops, "_fallback_reasons", set())


def test_reference_and_unknown_mode():
    assert ops.select("reference") is ops.REFERENCE
    with pytest.raises(ValueError, match="unknown kernels mode"):
        ops.select("fast")


def test_custom_and_auto_use_our_kernels_on_cpu(ext):
    for mode in ("custom", "auto"):
        opset = ops.select(mode, device="cpu")
        assert set(opset.sources.values()) == {"custom"}
        assert opset.rms_norm is custom.rms_norm and opset.linear_cross_entropy is custom.linear_cross_entropy


def test_paddle_mode_on_cpu_uses_builtins_where_registered():
    opset = ops.select("paddle", device="cpu")
    assert opset.sources["swiglu"] == "paddle" and opset.sources["cross_entropy_sum"] == "paddle"
    assert opset.sources["rms_norm"] == "reference" and opset.rotary is reference.rotary


def test_paddle_builtin_ops_match_reference():
    import numpy as np
    import paddle

    opset = ops.select("paddle", device="cpu")
    g = paddle.randn([5, 9]) * 4
    u = paddle.randn([5, 9])
    np.testing.assert_allclose(
        opset.swiglu(g, u).numpy(), reference.swiglu(g, u).numpy(), rtol=1e-5, atol=1e-6
    )
    logits = paddle.randn([6, 11])
    labels = paddle.to_tensor([1, -100, 3, 10, -100, 0])
    s, c = opset.cross_entropy_sum(logits, labels)
    sr, cr = reference.cross_entropy_sum(logits, labels)
    np.testing.assert_allclose(float(s), float(sr), rtol=1e-5)
    assert float(c) == float(cr) == 4.0


def test_auto_falls_back_with_one_warning(broken_build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ops.select("auto", device="cpu")
        ops.select("auto", device="cpu:1")  # another device: still no second warning
    fallbacks = [w for w in caught if issubclass(w.category, ops.KernelFallbackWarning)]
    assert len(fallbacks) == 1 and "kernel sources not found" in str(fallbacks[0].message)
    assert "custom" not in first.sources.values()
    assert first.sources["swiglu"] == "paddle" and first.sources["rms_norm"] == "reference"


def test_no_compiler_is_one_line_for_ops_and_adamw(monkeypatch):
    """Without a compiler the ops and the CPU AdamW fall back for the same reason: the user reads one
    line, `warning: custom kernels unavailable (no C++ compiler found: install g++ ...)`."""
    from bmtrain_cli.cli import _one_line_notices
    from bmtrain_cli.train.optimizer import cpu_adamw

    monkeypatch.setattr(build, "find_cxx", lambda: None)
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(ops, "_cache", {})
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.setattr(ops, "_fallback_reasons", set())
    monkeypatch.setattr(cpu_adamw, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops.select("auto", device="cpu")
        opt = cpu_adamw.CpuAdamW(1e-3, parameters=paddle.nn.Linear(2, 2).parameters())
    assert not opt.fused
    said = [w for w in caught if issubclass(w.category, ops.KernelFallbackWarning)]
    assert len(said) == 1
    text = _one_line_notices(warnings.formatwarning)(
        said[0].message, said[0].category, said[0].filename, said[0].lineno
    )
    assert text.count("\n") == 1 and text.startswith("warning: custom kernels unavailable (no C++ compiler")
    assert "install g++" in text


def test_custom_fails_clearly_when_unbuildable(broken_build):
    with pytest.raises(UserError, match="kernels is 'custom'.*kernel sources not found"):
        ops.select("custom", device="cpu")


def test_custom_refuses_gpu_without_cuda_build(ext, monkeypatch):
    monkeypatch.setattr(ops, "_cache", {})
    if build.plan()[3]:
        pytest.skip("this machine builds the CUDA kernels")
    with pytest.raises(UserError, match="built for CPU only"):
        ops.select("custom", device="gpu:0")


def test_build_is_cached(ext):
    """A second load in the same process returns the same module; the key depends on the sources."""
    assert build.load_extension() is ext
    sources, cxx, cuda, _ = build.plan()
    assert build.build_key(sources, cxx, cuda) == build.build_key(sources, cxx, cuda)
    assert build.build_key(sources, cxx + ["-DX"], cuda) != build.build_key(sources, cxx, cuda)


TINY = ops.OpShapes(hidden=32, heads=2, kv_heads=1, head_dim=16, ffn=48, vocab=64, tied=True)


def test_measured_choice_takes_the_faster_candidate():
    """A candidate made slower (a 5 ms sleep) loses to the same op without it."""
    import time

    from bmtrain_cli.ops import measure

    def slow_norm(x, w, eps):
        time.sleep(0.005)
        return reference.rms_norm(x, w, eps)

    picks = measure.choose(
        TINY,
        {
            "custom": {"rms_norm": slow_norm, "swiglu": reference.swiglu},
            "reference": {"rms_norm": reference.rms_norm},
        },
    )
    assert picks["rms_norm"][0] == "reference"
    assert picks["rms_norm"][1]["custom"] > picks["rms_norm"][1]["reference"]
    assert "swiglu" not in picks  # one candidate only: nothing to time
    # the static order's candidate (what the memory plan counts) loses only by more than SWITCH_MARGIN
    default = {"rms_norm": "custom"}
    slow = measure.choose(
        TINY, {"custom": {"rms_norm": slow_norm}, "reference": {"rms_norm": reference.rms_norm}}, default
    )
    assert slow["rms_norm"][0] == "reference"
    same = measure.choose(
        TINY,
        {"custom": {"rms_norm": reference.rms_norm}, "reference": {"rms_norm": reference.rms_norm}},
        default,
    )
    assert same["rms_norm"][0] == "custom"  # equal speed: the static order stays


def test_auto_with_shapes_on_cpu_picks_each_ops_fastest(ext, monkeypatch, tmp_path):
    monkeypatch.setattr(ops, "_cache", {})
    monkeypatch.setenv("BMTRAIN_KERNEL_CHOICES", str(tmp_path / "choices.json"))  # no earlier record
    monkeypatch.delenv("BMTRAIN_KERNEL_CHOICE", raising=False)
    opset = ops.select("auto", device="cpu", shapes=TINY)
    assert set(opset.timings) == set(ops.OP_NAMES)  # every op has our kernel and the reference at least
    for op, times in opset.timings.items():
        assert {"custom", "reference"} <= set(times)
        fastest = min(times, key=times.__getitem__)
        if opset.sources[op] != fastest:  # kept the static order's kernel: not faster by the margin
            assert opset.sources[op] == "custom"
            assert times[fastest] * measure.SWITCH_MARGIN > times["custom"]
        impl = {"custom": getattr(custom, op), "reference": getattr(reference, op)}.get(opset.sources[op])
        assert impl is None or getattr(opset, op) is impl
    assert ops.select("auto", device="cpu", shapes=TINY) is opset  # cached per shape


@pytest.mark.parametrize("env", [{"BMTRAIN_KERNEL_CHOICE": "static"}, {"PADDLE_TRAINERS_NUM": "2"}])
def test_auto_keeps_the_static_order_when_measuring_is_off(ext, monkeypatch, env):
    monkeypatch.setattr(ops, "_cache", {})
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    opset = ops.select("auto", device="cpu", shapes=TINY)
    assert opset.timings == {}
    assert set(opset.sources.values()) == {"custom"}
