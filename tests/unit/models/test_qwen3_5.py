"""Qwen3.5 (qwen3_5_text): the chunked gated delta rule equals the token-by-token rule, and the model
equals transformers' beyond the shared parity tests (left-padded generation, its
weights written back name for name, its parameter count, LoRA on transformers' module names)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.models import load_pretrained, save_pretrained
from bmtrain_cli.models.param_count import count_parameters
from bmtrain_cli.ops import reference

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "qwen3_5_text"


def _inputs(s: int, seed: int = 0, b: int = 2, h: int = 3, dk: int = 8, dv: int = 5) -> list:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, s, h, dk))
    k = rng.standard_normal((b, s, h, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, s, h, dv))
    g = -rng.uniform(0.0, 3.0, (b, s, h))  # strong decays too: exp(cumsum) underflows within a chunk
    beta = rng.uniform(0.0, 1.0, (b, s, h))
    state = rng.standard_normal((b, h, dk, dv))
    return [paddle.to_tensor(a, dtype="float64", stop_gradient=False) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("s,chunk", [(1, 4), (7, 4), (37, 8), (37, 64), (130, 64)])
def test_chunked_rule_equals_the_recurrent_one(s, chunk):
    q, k, v, g, beta, state = _inputs(s)
    want, want_state = reference.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    got, got_state = reference.gated_delta_rule(q, k, v, g, beta, state, chunk=chunk)
    assert np.abs(got.numpy() - want.numpy()).max() < 1e-10
    assert np.abs(got_state.numpy() - want_state.numpy()).max() < 1e-10
    # from a zero state too (the training path: no state given)
    got0, _ = reference.gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    want0, _ = reference.gated_delta_rule_recurrent(q, k, v, g, beta, paddle.zeros_like(state))
    assert np.abs(got0.numpy() - want0.numpy()).max() < 1e-10


def test_chunked_rule_gradients_equal_the_recurrent_ones():
    tensors = _inputs(23, seed=1)
    weights = paddle.to_tensor(np.random.default_rng(2).standard_normal((2, 23, 3, 5)), dtype="float64")
    grads = []
    for rule in (reference.gated_delta_rule_recurrent, lambda *a: reference.gated_delta_rule(*a, chunk=8)):
        out, state = rule(*tensors)
        loss = (out * weights).sum() + (state * state).sum()
        grads.append([t.numpy() for t in paddle.grad(loss, tensors)])
    for want, got in zip(*grads):
        assert np.abs(got - want).max() < 1e-9 * max(1.0, np.abs(want).max())


def _ref() -> dict:
    return dict(np.load(FIXTURE / "reference.npz"))


def test_left_padded_greedy_generation_equals_transformers():
    from bmtrain_cli.models.decoding import SamplingOptions
    from bmtrain_cli.models.generate import generate

    ref = _ref()
    model = load_pretrained(FIXTURE)
    prompts = [[int(t) for t, m in zip(row, row != 0) if m] for row in ref["left_prompts"]]
    assert [len(p) for p in prompts] == [6, 3]
    got = generate(model, prompts, SamplingOptions(max_new_tokens=ref["generated_left"].shape[1]))
    assert got == ref["generated_left"].tolist()
    # and the cache path equals recomputing the whole sequence every step
    assert generate(model, prompts, SamplingOptions(max_new_tokens=5), use_cache=False) == [
        row[:5] for row in got
    ]


def test_save_pretrained_writes_transformers_names_and_values(tmp_path):
    from bmtrain_cli.models.safetensors_io import SafetensorsFile

    model = load_pretrained(FIXTURE)
    save_pretrained(model, tmp_path / "out")
    theirs = SafetensorsFile(FIXTURE / "model.safetensors")
    ours = SafetensorsFile(tmp_path / "out" / "model.safetensors")
    assert set(ours.names()) == set(theirs.names())
    for n in ours.names():
        np.testing.assert_array_equal(ours.get(n), theirs.get(n))
    assert count_parameters(model.arch) == sum(int(np.prod(p.shape)) for p in model.parameters())


def test_lora_wraps_the_linear_attention_projections():
    from types import SimpleNamespace

    from bmtrain_cli.lora.inject import apply_lora

    model = load_pretrained(FIXTURE)
    cfg = SimpleNamespace(lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear")
    wrapped = apply_lora(model, cfg)
    assert "model.layers.0.linear_attn.in_proj_qkv" in wrapped
    assert "model.layers.0.linear_attn.out_proj" in wrapped
    assert "model.layers.2.self_attn.q_proj" in wrapped
    assert not any("conv1d" in n for n in wrapped)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_a_packed_row_equals_its_samples_run_alone(kernels):
    """Rows packing samples (segment ids 1, 2, ... and padding 0, positions restarting per sample, as the
    packed collate writes them): every sample's logits and its loss gradient equal its own run's, the
    linear layers' state and convolution starting afresh at each sample (three samples, one longer than
    a 64-token chunk, so the chunk boundaries move)."""
    model = load_pretrained(FIXTURE, kernels=kernels)
    rng = np.random.default_rng(0)
    lengths = [[9, 70], [5, 17, 20]]
    width = 83
    ids = np.zeros((2, width), dtype=np.int64)
    seg, pos = np.zeros_like(ids), np.zeros_like(ids)
    samples = []
    for r, row in enumerate(lengths):
        at = 0
        for i, n in enumerate(row):
            tokens = rng.integers(3, 380, n)
            ids[r, at : at + n], seg[r, at : at + n], pos[r, at : at + n] = tokens, i + 1, np.arange(n)
            samples.append((r, at, tokens))
            at += n
    packed = model(paddle.to_tensor(ids), paddle.to_tensor(seg), paddle.to_tensor(pos))
    for r, at, tokens in samples:
        alone = model(paddle.to_tensor(tokens[None]))
        got = packed[r, at : at + len(tokens)]
        np.testing.assert_allclose(got.numpy(), alone[0].numpy(), rtol=1e-5, atol=2e-5)
    # one sample's outputs of a linear layer take gradient from its own inputs only (no state leaks)
    layer = model.model.layers[0].linear_attn
    x = paddle.to_tensor(rng.standard_normal((2, width, 64)), dtype="float32", stop_gradient=False)
    layer(x, paddle.to_tensor(seg))[1, 5:22].sum().backward()  # the second sample of row 1
    reach = np.abs(x.grad.numpy()).sum(-1)
    assert np.all(reach[1, 5:22] > 0)
    assert not reach[0].any() and not reach[1, :5].any() and not reach[1, 22:].any()


@pytest.mark.parametrize(
    "override, where",
    [
        ("parallel_config.tensor_parallel=32", "parallel_config.tensor_parallel"),  # 16 key heads
        ("train_config.to_static=true,train_config.batching=packed", "train_config.to_static"),
    ],
)
def test_validate_config_refuses_what_the_linear_attention_does_not_run(override, where):
    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.errors import ConfigError

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    with pytest.raises(ConfigError) as exc:
        load_config(quickstart, ["model_config.family=qwen3_5_text", *override.split(",")], mode="validate")
    ours = [p for p in exc.value.problems if "Gated DeltaNet" in p.format()]
    assert ours and any(p.path == where for p in ours), [p.format() for p in exc.value.problems]


@pytest.mark.slow
def test_to_static_loss_and_gradients_equal_dygraph():
    """train_config.to_static compiles ``loss_sum`` (train/loop/to_static.py) over the linear layers' chunk
    loop: the loss and every gradient equal the dygraph model's (the delta rule in Paddle ops in both;
    measured 0 and 7e-6 of each gradient's largest element), over two backward passes (the second one
    reusing the compiled program)."""
    from bmtrain_cli.train.loop.to_static import compile_loss_sum

    ref = _ref()
    args = [paddle.to_tensor(ref[k]) for k in ("input_ids", "labels", "right_mask")]
    results = []
    for static in (False, True):
        model = load_pretrained(FIXTURE, kernels="reference")
        model.train()
        loss_sum = compile_loss_sum(model) if static else model.loss_sum
        for _ in range(2):
            total, count = loss_sum(*args)
            (total / count).backward()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        results.append((float(total / count), grads))
    (want, want_grads), (got, got_grads) = results
    assert got == pytest.approx(want, rel=1e-6)
    assert set(got_grads) == set(want_grads) and len(want_grads) == len(list(model.parameters()))
    for name, g in want_grads.items():
        assert np.abs(got_grads[name] - g).max() <= 2e-5 * np.abs(g).max(), name


def test_validate_config_takes_what_the_linear_attention_runs():
    """to_static with unpacked rows, and LoRA under tensor parallel (lora/split_parts.py)."""
    from bmtrain_cli.config.load import load_config

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    family = "model_config.family=qwen3_5_text"
    static = load_config(quickstart, [family, "train_config.to_static=true"], mode="validate").config
    assert static.train.to_static and static.train.batching == "longest"
    sets = [family, "parallel_config.tensor_parallel=2", "train_config.finetuning=lora"]
    lora = load_config(quickstart, sets, mode="validate").config
    assert lora.parallel.tensor_parallel == 2 and lora.train.finetuning == "lora"


def test_plan_counts_the_linear_attention_layers():
    """bmtrain plan's parameters are the hybrid's exact count; its activations grow with the linear
    layers' chunk matrices and states (more value heads: more kept per token)."""
    from dataclasses import replace

    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.plan.devices import get_device
    from bmtrain_cli.plan.estimator import estimate_layout
    from bmtrain_cli.plan.workload import Layout, Workload

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    config = load_config(quickstart, ["model_config.family=qwen3_5_text"], mode="validate").config
    w = Workload.from_config(config)
    device, layout = get_device("cpu"), Layout(micro_batch=2)
    est = estimate_layout(w, layout, device)
    assert est.parameters == 4 * count_parameters(w.arch)
    shape = w.arch.linear_attention
    wider = replace(w, arch=replace(w.arch, linear_attention=replace(shape, num_value_heads=64)))
    assert estimate_layout(wider, layout, device).activations > est.activations
    # tensor parallel splits the linear layers' heads and projections: each rank holds half of every
    # matrix (the norms' vectors, a few hundred numbers, stay whole) and about half the activations
    split = estimate_layout(w, replace(layout, tp=2), device)
    assert est.parameters // 2 < split.parameters <= est.parameters // 2 + 4 * 1024
    assert split.activations < 0.55 * est.activations


def test_the_kernel_delta_rule_in_the_model_equals_the_reference_rule():
    """The model on our kernels in float64, once with the CPU delta rule and once with the Paddle-op rule in
    its place: the same loss and gradients (the rest of the op set alike); and the float32 model's loss on
    our kernels equals transformers'."""
    from dataclasses import replace

    ref = _ref()
    args = [paddle.to_tensor(ref[k]) for k in ("input_ids", "labels", "right_mask")]
    results = []
    for with_kernel in (True, False):
        model = load_pretrained(FIXTURE, kernels="custom")
        assert model.ops.delta_rule is not None
        if not with_kernel:
            ops = replace(model.ops, delta_rule=None)
            for layer in model.layers:
                if layer.layer_type == "linear_attention":
                    layer.linear_attn.ops = ops
        model.to(dtype="float64")
        model.train()
        total, count = model.loss_sum(args[0], args[1], attention_mask=args[2])
        (total / count).backward()
        results.append((float(total / count), {n: p.grad.numpy() for n, p in model.named_parameters()}))
    (loss, grads), (want_loss, want_grads) = results
    assert abs(loss - want_loss) <= 1e-12
    for name, want in want_grads.items():
        assert np.abs(grads[name] - want).max() <= 1e-9 * max(1.0, np.abs(want).max()), name
    model = load_pretrained(FIXTURE, kernels="custom")
    total, count = model.loss_sum(args[0], args[1], attention_mask=args[2])
    assert abs(float(total / count) - float(ref["loss"])) <= 1e-5


@pytest.mark.slow
def test_paddle_inference_export_equals_the_model_over_several_chunks(tmp_path):
    """The static graph's chunk loop: logits of 70- and 140-token rows (two and three chunks) equal the
    dygraph model's (to float32 rounding over the rows)."""
    from bmtrain_cli.export.paddle_inference import Predictor, export_paddle_inference

    model = load_pretrained(FIXTURE)
    export_paddle_inference(model, str(tmp_path / "pi"))
    predictor = Predictor(str(tmp_path / "pi"))
    for s in (70, 140):
        ids = np.random.default_rng(s).integers(3, 300, [2, s])
        want = model(paddle.to_tensor(ids)).numpy()
        # float32: the graph runs the Paddle-op chunked rule, the model our kernel where it is built
        assert np.abs(predictor.logits(ids) - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
