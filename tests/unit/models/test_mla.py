"""Multi-head latent attention and the deepseek_v3 family (models/blocks.py LatentAttention,
models/families/deepseek_v3.py): the settings the parity fixtures exercise each move the logits, the
parameter count, fresh models, Kimi-K2 configs and what is refused. Logit, loss and generation parity with
transformers are in test_hf_parity.py (fixtures deepseek_v3 and deepseek_v3_yarn)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.errors import UserError
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.arch import arch_from_hf_dict, arch_from_model_config, arch_to_hf_dict, lora_targets
from bmtrain_cli.models.blocks import LatentAttention
from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.models.generate import generate
from bmtrain_cli.models.hf import build
from bmtrain_cli.models.param_count import count_parameters

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
TOL = 1e-4  # test_hf_parity.py's


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _logits_with(tmp_path: Path, name: str, **changes) -> np.ndarray:
    """Our logits of the fixture's weights under a config.json with ``changes`` (None: key removed)."""
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d, dirs_exist_ok=True)
    cfg = _config(name)
    for key, value in changes.items():
        target = cfg["rope_parameters"] if key in ("mscale_all_dim",) else cfg
        target.pop(key) if value is None else target.__setitem__(key, value)
    (d / "config.json").write_text(json.dumps(cfg))
    ref = dict(np.load(FIXTURES / name / "reference.npz"))
    return np.abs(load_pretrained(d)(paddle.to_tensor(ref["input_ids"])).numpy() - ref["logits"]).max()


@pytest.mark.parametrize(
    "name, changes",
    [
        ("deepseek_v3", dict(rope_interleave=False)),  # interleaved pairs, not halves
        ("deepseek_v3_yarn", dict(mscale_all_dim=None)),  # YaRN's mscale squared on the softmax scale
        ("deepseek_v3_yarn", dict(rope_interleave=True)),
    ],
)
def test_each_setting_the_fixtures_exercise_moves_the_logits_past_the_tolerance(tmp_path, name, changes):
    assert _logits_with(tmp_path, name, **changes) > 10 * TOL


def test_layers_and_parameter_count():
    for name, q_lora in (("deepseek_v3", True), ("deepseek_v3_yarn", False)):
        model = load_pretrained(FIXTURES / name)
        arch = model.arch
        assert (arch.kv_lora_rank, arch.qk_nope_head_dim, arch.head_dim) == (16, 16, 8)
        assert arch.v_head_dim == (12 if q_lora else 28) and bool(arch.q_lora_rank) == q_lora
        attn = model.layers[0].self_attn
        assert isinstance(attn, LatentAttention) and hasattr(attn, "q_a_proj") == q_lora
        assert [layer.sparse for layer in model.layers] == [False, True, True]  # first_k_dense_replace 1
        assert count_parameters(arch) == sum(int(np.prod(p.shape)) for p in model.parameters())


def test_cached_generation_equals_recomputing_every_step():
    """The cache holds the expanded (zero-padded) keys and values: decoding with it gives the tokens of
    recomputing the whole sequence each step, for values narrower and wider than the q/k heads."""
    for name in ("deepseek_v3", "deepseek_v3_yarn"):
        model = load_pretrained(FIXTURES / name)
        prompts = [[5, 9, 11, 40], [7, 3]]
        cached = generate(model, prompts, SamplingOptions(max_new_tokens=8))
        assert cached == generate(model, prompts, SamplingOptions(max_new_tokens=8), use_cache=False)


def test_config_round_trip_and_kimi_k2():
    cfg = _config("deepseek_v3_yarn")
    arch = arch_from_hf_dict(cfg)
    out = arch_to_hf_dict(arch)
    assert out["q_lora_rank"] is None and out["qk_rope_head_dim"] == 8 and out["rope_interleave"] is False
    assert arch_from_hf_dict(out) == arch
    # Kimi-K2 ships DeepSeek-V3's architecture under model_type kimi_k2; written back as deepseek_v3
    kimi = arch_from_hf_dict(
        {**_config("deepseek_v3"), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1}
    )
    assert kimi.family == "deepseek_v3" and kimi.moe_groups == 1
    assert arch_to_hf_dict(kimi)["model_type"] == "deepseek_v3"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_key_value_heads=2), "key/value heads"),
        (dict(quantization_config={"quant_method": "fp8"}), "FP8"),
        (dict(scoring_func="softmax"), "router"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(n_group=3), "equal groups"),
    ],
)
def test_refusals(change, match):
    with pytest.raises(UserError, match=match):
        arch_from_hf_dict({**_config("deepseek_v3"), **change})


def test_a_fresh_model_from_model_config_trains():
    cfg = ModelConfig(
        family="deepseek_v3", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64
    )
    arch = arch_from_model_config(cfg)
    assert arch.kv_lora_rank > 0 and arch.head_dim == 8 and arch.is_sparse(1) and not arch.is_sparse(0)
    paddle.seed(0)
    model = build(cfg)
    assert count_parameters(arch) == sum(int(np.prod(p.shape)) for p in model.parameters())
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    ids = paddle.randint(0, 64, [4, 12])
    losses = []
    for _ in range(3):
        total, count = model.loss_sum(ids, ids)
        (total / count).backward()
        assert model.layers[0].self_attn.kv_b_proj.weight.grad is not None
        opt.step()
        opt.clear_grad()
        losses.append(float(total / count))
    assert losses[-1] < losses[0]


def test_the_planner_counts_latent_attention_parameters():
    """plan's per-layer parameters (plan/activations.py layer_params) of a latent-attention layer add up to
    count_parameters (dense layers: the planner's expert accounting is the MoE families' own) and its kept
    activations grow with the latent and head widths, not with the rope part alone."""
    from dataclasses import replace

    from bmtrain_cli.plan.activations import latent_attention_elems, layer_params

    for name in ("deepseek_v3", "deepseek_v3_yarn"):
        arch = replace(arch_from_hf_dict(_config(name)), num_experts=0)
        mats, vecs = layer_params(arch, 1)
        embeddings = 2 * arch.vocab_size * arch.hidden_size + arch.hidden_size
        assert arch.num_hidden_layers * (mats + vecs) + embeddings == count_parameters(arch)
        wider = replace(arch, v_head_dim=arch.v_head_dim + 64, kv_lora_rank=arch.kv_lora_rank + 8)
        # all-linear reaches the latent projections here only (the plan counts its adapters per target)
        assert "kv_b_proj" in lora_targets(arch, "all-linear")
        assert "kv_b_proj" not in lora_targets(replace(arch, kv_lora_rank=0), "all-linear")
        assert (
            latent_attention_elems(wider) > latent_attention_elems(arch) + 3 * arch.num_attention_heads * 40
        )


def test_lora_on_the_latent_projections_trains_and_all_linear_reaches_the_experts():
    from types import SimpleNamespace

    from bmtrain_cli.lora.inject import apply_lora

    def settings(targets):
        return SimpleNamespace(
            lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=targets, seed=0
        )

    every = apply_lora(load_pretrained(FIXTURES / "deepseek_v3"), settings("all-linear"))
    # 5 latent-attention projections x 3 layers, layer 0's dense MLP, then 1 shared + 8 routed experts'
    # gate/up/down in each of the 2 sparse layers
    assert len(every) == 5 * 3 + 3 + 2 * (1 + 8) * 3
    assert sum(".mlp.experts.7." in n for n in every) == 2 * 3 and sum("kv_b_proj" in n for n in every) == 3
    model = load_pretrained(FIXTURES / "deepseek_v3")
    model.train()
    wrapped = apply_lora(
        model, settings(["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    )
    assert len(wrapped) == 5 * 3
    ref = dict(np.load(FIXTURES / "deepseek_v3" / "reference.npz"))
    total, count = model.loss_sum(paddle.to_tensor(ref["input_ids"]), paddle.to_tensor(ref["labels"]))
    (total / count).backward()
    trainable = [p for p in model.parameters() if not p.stop_gradient]
    assert len(trainable) == 2 * 5 * 3 and all(p.grad is not None for p in trainable)


@pytest.mark.parametrize(
    "kernels, implementation", [("auto", "eager"), ("auto", "sdpa"), ("reference", "auto")]
)
def test_every_cpu_attention_path_runs_the_padded_heads_exactly(kernels, implementation):
    """The zero-padded q/k/v go through eager, sdpa and (kernels: reference) the pure-Paddle paths as through
    the fused CPU kernel of test_hf_parity.py: transformers' logits on right- and left-padded rows."""
    for name in ("deepseek_v3", "deepseek_v3_yarn"):
        ref = dict(np.load(FIXTURES / name / "reference.npz"))
        model = load_pretrained(FIXTURES / name, kernels=kernels, attention_implementation=implementation)
        ids = paddle.to_tensor(ref["input_ids"])
        for mask, want, pos in (
            ("right_mask", "logits_right_mask", None),
            ("left_mask", "logits_left_mask", 1),
        ):
            kwargs = {"position_ids": paddle.to_tensor(ref["left_position_ids"])} if pos else {}
            got = model(ids, attention_mask=paddle.to_tensor(ref[mask]), **kwargs).numpy()
            valid = ref[mask].astype(bool)
            assert np.abs(got[valid] - ref[want][valid]).max() <= TOL


def test_the_blocked_kernel_gives_the_eager_loss_and_gradients(monkeypatch):
    """Past DENSE_MAX_SEQ without the fused CPU kernel training runs the blocked kernel (its own backward):
    on the padded heads it gives eager attention's loss and the latent projections' gradients."""
    from bmtrain_cli.models import attention

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return blocked(*args, **kwargs)

    blocked = attention.blocked_attention
    monkeypatch.setattr(attention, "blocked_attention", counted)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(3, 384, [1, 300]))
    mask = paddle.to_tensor(np.array([[1] * 180 + [2] * 120]))  # two packed segments
    out = {}
    for implementation in ("auto", "eager"):
        model = load_pretrained(
            FIXTURES / "deepseek_v3_yarn", kernels="reference", attention_implementation=implementation
        )
        model.train()
        total, count = model.loss_sum(ids, ids, attention_mask=mask)
        (total / count).backward()
        attn = model.layers[1].self_attn
        out[implementation] = (
            float(total / count),
            attn.kv_b_proj.weight.grad.numpy(),
            attn.q_proj.weight.grad.numpy(),
        )
    assert calls and all(shape[-1] == 28 for shape in calls)  # v_head_dim 28 > 24 q/k: the width
    (la, *ga), (lb, *gb) = out["auto"], out["eager"]
    assert abs(la - lb) <= 1e-5
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)
