"""Mixture of experts (models/moe.py; families qwen3_moe, mixtral, ernie4_5_moe, glm4_moe): the auxiliary
load-balancing loss
against transformers' (fixtures from tests/fixtures/hf/make_fixtures.py), the checkpoint names of the hub
and of transformers 5.x, a fresh model's training step, and what is refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.errors import UserError
from bmtrain_cli.models import load_pretrained, save_pretrained
from bmtrain_cli.models.arch import arch_from_hf_dict, arch_from_model_config, arch_to_hf_dict
from bmtrain_cli.models.hf import build, load_hf_state_dict
from bmtrain_cli.models.moe import SparseMoE
from bmtrain_cli.models.param_count import count_active_parameters, count_parameters
from bmtrain_cli.models.safetensors_io import checkpoint_files

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
MOE = ("qwen3_moe", "mixtral", "ernie4_5_moe")  # the families transformers gives an auxiliary loss
ALL_MOE = (*MOE, "glm4_moe", "deepseek_v3")
EXPERTS_KEY = {
    "qwen3_moe": "num_experts",
    "mixtral": "num_local_experts",
    "glm4_moe": "n_routed_experts",
    "deepseek_v3": "n_routed_experts",
}


def _ref(name: str) -> dict:
    return dict(np.load(FIXTURES / name / "reference.npz"))


def _tensors(d: Path) -> dict:
    return {n: f.get(n) for f in checkpoint_files(d) for n in f.names()}


@pytest.mark.parametrize("name", MOE)
def test_loss_with_aux_matches_transformers(name, tmp_path):
    """output_router_logits=True: loss_sum / count is transformers' cross-entropy + coef x aux, with the
    padded tokens left out of the aux loss as transformers leaves them out."""
    ref = _ref(name)
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["output_router_logits"] = True
    (d / "config.json").write_text(json.dumps(cfg))
    model = load_pretrained(d)
    assert model.arch.output_router_logits and model.arch.router_aux_loss_coef == 0.02
    total, count = model.loss_sum(
        paddle.to_tensor(ref["input_ids"]),
        paddle.to_tensor(ref["labels"]),
        attention_mask=paddle.to_tensor(ref["right_mask"]),
    )
    assert model.last_aux_loss is not None
    assert abs(float(model.last_aux_loss) - float(ref["aux_loss"])) <= 1e-6
    assert abs(float(total) / float(count) - float(ref["loss_aux"])) <= 1e-5
    assert float(ref["loss_aux"]) != pytest.approx(float(ref["loss"]), abs=1e-3)  # the aux term shows


@pytest.mark.parametrize("name", ALL_MOE)
def test_transformers_5_fused_expert_layout_loads(name):
    """transformers 5.x keeps the experts stacked in memory (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I], Mixtral's block_sparse_moe renamed mlp): read as the same model."""
    ref = _ref(name)
    hub = load_pretrained(FIXTURES / name)
    tensors = _tensors(FIXTURES / name)
    fused = {}
    for n, t in tensors.items():
        n = n.replace(".block_sparse_moe.", ".mlp.").replace(".w1.", ".gate_proj.")
        n = n.replace(".w3.", ".up_proj.").replace(".w2.", ".down_proj.")
        fused[n] = t
    E = hub.arch.num_experts
    for i, layer in enumerate(hub.layers):
        if not layer.sparse:
            continue
        p = f"model.layers.{i}.mlp.experts"
        gate = [fused.pop(f"{p}.{e}.gate_proj.weight") for e in range(E)]
        up = [fused.pop(f"{p}.{e}.up_proj.weight") for e in range(E)]
        down = [fused.pop(f"{p}.{e}.down_proj.weight") for e in range(E)]
        fused[f"{p}.gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        fused[f"{p}.down_proj"] = np.stack(down)
    model = build(hub.arch)
    model.eval()
    load_hf_state_dict(model, fused)
    ids = paddle.to_tensor(ref["input_ids"])
    np.testing.assert_array_equal(model(ids).numpy(), hub(ids).numpy())


@pytest.mark.parametrize("name", ALL_MOE)
def test_save_pretrained_round_trip_keeps_the_hub_names(name, tmp_path):
    model = load_pretrained(FIXTURES / name)
    save_pretrained(model, tmp_path)
    assert set(_tensors(tmp_path)) == set(_tensors(FIXTURES / name))
    theirs = json.loads((FIXTURES / name / "config.json").read_text())
    ours = json.loads((tmp_path / "config.json").read_text())
    experts = 8 if name in ("glm4_moe", "deepseek_v3") else 4
    assert ours[EXPERTS_KEY.get(name, "moe_num_experts")] == experts
    assert ours["moe_k" if name == "ernie4_5_moe" else "num_experts_per_tok"] == 2
    assert arch_from_hf_dict(ours) == replace(arch_from_hf_dict(theirs), extra=arch_from_hf_dict(ours).extra)
    again = load_pretrained(tmp_path)
    ids = paddle.to_tensor(_ref(name)["input_ids"])
    np.testing.assert_array_equal(again(ids).numpy(), model(ids).numpy())


def test_qwen3_moe_dense_layers_and_parameter_counts():
    model = load_pretrained(FIXTURES / "qwen3_moe")
    arch = model.arch
    assert arch.mlp_only_layers == (0,) and arch.moe_intermediate_size == 48
    assert [layer.sparse for layer in model.layers] == [False, True, True]
    assert isinstance(model.layers[1].mlp, SparseMoE) and not isinstance(model.layers[0].mlp, SparseMoE)
    assert count_parameters(arch) == sum(int(np.prod(p.shape)) for p in model.parameters())
    # an active token passes 2 of the 4 experts of each sparse layer
    assert count_parameters(arch) - count_active_parameters(arch) == 2 * 2 * 3 * 64 * 48


def fresh_qwen3_moe(router_aux_loss_coef: float = 0.01) -> ModelConfig:
    """The model_config of a tiny fresh Qwen3-MoE (vocabulary 64, 4 experts, top 2, the load-balancing
    loss on)."""
    return ModelConfig(
        family="qwen3_moe",
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=router_aux_loss_coef,
    )


def test_a_fresh_qwen3_moe_trains_one_step_with_a_finite_aux_loss():
    cfg = fresh_qwen3_moe()
    arch = arch_from_model_config(cfg)
    assert arch.moe_intermediate_size == 48 and arch.num_experts == 4  # experts as wide as the MLP
    paddle.seed(0)
    model = build(cfg)
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    ids = paddle.randint(0, 64, [4, 12])
    losses = []
    for _ in range(2):
        total, count = model.loss_sum(ids, ids)
        (total / count).backward()
        assert model.layers[1].mlp.gate.weight.grad is not None
        opt.step()
        opt.clear_grad()
        losses.append(float(total / count))
        aux = float(model.last_aux_loss)
        assert np.isfinite(aux) and aux > 0  # num_experts_per_tok (2) when perfectly balanced
    assert losses[1] < losses[0]


def test_refusals():
    with pytest.raises(UserError, match="no mixture of experts"):
        build(arch_from_model_config(ModelConfig(family="llama", num_experts=4)))
    with pytest.raises(UserError, match="num_experts_per_tok"):
        build(arch_from_model_config(ModelConfig(family="mixtral", num_experts=2, num_experts_per_tok=3)))
    arch = replace(
        arch_from_model_config(ModelConfig(family="qwen3_moe", hidden_size=32)), output_router_logits=True
    )
    with pytest.raises(UserError, match="recompute"):
        build(arch).enable_recompute("full")


def test_hub_config_without_aux_keeps_it_off():
    cfg = arch_to_hf_dict(arch_from_hf_dict(json.loads((FIXTURES / "mixtral" / "config.json").read_text())))
    assert cfg["output_router_logits"] is False and cfg["num_local_experts"] == 4


def test_lora_on_the_attention_leaves_the_experts_frozen():
    from types import SimpleNamespace

    from bmtrain_cli.lora.inject import apply_lora

    model = load_pretrained(FIXTURES / "qwen3_moe")
    model.train()
    settings = SimpleNamespace(
        lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj", "v_proj"], seed=0
    )
    wrapped = apply_lora(model, settings)
    assert len(wrapped) == 2 * 3
    ref = _ref("qwen3_moe")
    total, count = model.loss_sum(paddle.to_tensor(ref["input_ids"]), paddle.to_tensor(ref["labels"]))
    (total / count).backward()
    trainable = [p for p in model.parameters() if not p.stop_gradient]
    assert trainable and all(p.grad is not None for p in trainable)
    assert model.layers[1].mlp.gate.weight.grad is None  # frozen


@pytest.mark.parametrize(
    "override, where",
    [
        (
            "parallel_config.tensor_parallel=2 model_config.family=glm4_moe model_config.moe_intermediate_size=33",
            "parallel_config.tensor_parallel",
        ),
        ("train_config.to_static=true", "train_config.to_static"),
    ],
)
def test_validate_config_refuses_what_the_moe_slice_does_not_run(override, where):
    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.errors import ConfigError

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    sets = ["model_config.family=qwen3_moe", *override.split()]
    with pytest.raises(ConfigError) as exc:
        load_config(quickstart, sets, mode="validate")
    moe = [p for p in exc.value.problems if "mixture" in p.message or "mixture" in str(p.format())]
    assert moe and any(p.path == where for p in moe), [p.format() for p in exc.value.problems]
    assert "quickstart.yaml" in moe[0].format() or "--set" in moe[0].format()  # placed: file:line or --set


@pytest.mark.parametrize(
    "family, sets, reason",
    [
        ("qwen3_moe", [], None),
        ("deepseek_v3", [], None),
        ("glm4_moe", [], None),
        ("qwen3_moe", ["model_config.moe_intermediate_size=33"], None),  # no shared experts to split
        ("glm4_moe", ["model_config.moe_intermediate_size=33"], "shared experts' width (33)"),
    ],
)
def test_tensor_parallel_splits_attention_and_shared_experts(family, sets, reason):
    """tp2 runs an MoE whose attention (latent attention too) and shared experts the layer factory splits
    and whose router and routed experts stay whole; a shared-expert width tp does not divide is refused."""
    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.errors import ConfigError

    quickstart = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
    sets = [f"model_config.family={family}", "parallel_config.tensor_parallel=2", *sets]
    try:
        load_config(quickstart, sets, mode="validate", world_size=2)
        problems = []
    except ConfigError as exc:
        problems = [p.message for p in exc.problems if p.path == "parallel_config.tensor_parallel"]
    if reason is None:
        assert not problems, problems
    else:
        assert any(reason in m and "mixture of experts" in m for m in problems), problems


def test_ernie4_5_moe_layers_shared_experts_and_score_bias():
    model = load_pretrained(FIXTURES / "ernie4_5_moe")
    arch = model.arch
    assert [layer.sparse for layer in model.layers] == [False, True, True]  # moe_layer_start_index 1
    moe = model.layers[1].mlp
    assert moe.shared_experts is not None and moe.gate.moe_statics is not None
    bias = moe.gate.moe_statics.e_score_correction_bias
    assert bias.stop_gradient and float(paddle.abs(bias).sum()) > 0  # the fixture's random bias, frozen
    assert count_parameters(arch) == sum(int(np.prod(p.shape)) for p in model.parameters())
    cfg = json.loads((FIXTURES / "ernie4_5_moe" / "config.json").read_text())
    with pytest.raises(UserError, match="use_bias"):
        arch_from_hf_dict({**cfg, "use_bias": True})


def test_bmtrain_train_logs_the_aux_loss_of_a_fresh_qwen3_moe(tmp_path):
    """`bmtrain train` on a fresh qwen3_moe with the aux loss on: train/aux_loss in metrics.jsonl, finite,
    and the checkpoint holds the experts under the hub's names."""
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
  micro_batch_size: 8
  learning_rate: 3.0e-3
  warmup_steps: 1
  logging_steps: 1
  save_steps: 2
  eval_steps: 2
  num_workers: 0
""",
        encoding="utf-8",
    )
    sets = [
        "model_config.family=qwen3_moe",
        "model_config.num_experts=4",
        "model_config.output_router_logits=true",
    ]
    args = ["train", "--config", str(cfg)] + [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = tmp_path / "out"
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    aux = [r["aux_loss"] for r in recs if "aux_loss" in r]
    assert len(aux) == 2 and all(np.isfinite(a) and a > 0 for a in aux)
    ckpt = out / "checkpoints" / "step-2"
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in _tensors(ckpt)
    assert load_pretrained(ckpt).arch.num_experts == 4


def test_experts_without_tokens_get_zero_gradients_not_none():
    """Data parallel sums the same gradient list on every rank: an expert no token reached this step has a
    zero gradient, not a missing one."""
    paddle.seed(0)
    model = build(replace(_fresh_arch(), num_experts=8))
    ids = paddle.to_tensor([[5, 6]])  # 2 tokens x top-2: at most 4 of the 8 experts per layer
    total, _ = model.loss_sum(ids, ids)
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".experts." in n}
    assert all(g is not None for g in grads.values())
    assert any(float(paddle.abs(g).sum()) == 0.0 for g in grads.values())


def _fresh_arch():
    return arch_from_model_config(
        ModelConfig(
            family="qwen3_moe", hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
        )
    )


def _route_reference(logits, bias, groups, topk_groups, top_k, scale):
    """GLM-4.5 / DeepSeek-V3 routing in numpy, token by token: sigmoid scores, groups ranked by the sum of
    their two best biased scores, the top-k among the best groups' experts, weighted by the unbiased scores
    renormalised and scaled."""
    scores = 1 / (1 + np.exp(-logits))
    weights, chosen = [], []
    for row in scores:
        biased = (row + bias).reshape(groups, -1)
        best = np.argsort(-np.sort(biased, axis=1)[:, -2:].sum(axis=1))[:topk_groups]
        allowed = np.concatenate([g * biased.shape[1] + np.arange(biased.shape[1]) for g in best])
        pick = allowed[np.argsort(-(row + bias)[allowed])[:top_k]]
        w = row[pick] / row[pick].sum() * scale
        order = np.argsort(pick)
        chosen.append(pick[order])
        weights.append(w[order])
    return np.array(weights), np.array(chosen)


def test_sigmoid_group_limited_routing_equals_a_reference():
    """glm4_moe's router on random logits: the chosen experts and weights equal an independent numpy
    reading of transformers' rule, and the groups and the bias change the choice for some tokens (so both
    are exercised)."""
    model = load_pretrained(FIXTURES / "glm4_moe")
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and moe.groups == 4 and moe.topk_groups == 2 and moe.scaling == 2.5
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 2, (64, 8)).astype("float32")
    bias = moe.gate.moe_statics.e_score_correction_bias.numpy()
    assert np.abs(bias).max() > 0
    weights, chosen = moe._route(paddle.to_tensor(logits))
    order = np.argsort(chosen.numpy(), axis=1)
    got_chosen = np.take_along_axis(chosen.numpy(), order, axis=1)
    got_weights = np.take_along_axis(weights.numpy(), order, axis=1)
    want_weights, want_chosen = _route_reference(logits, bias, 4, 2, 2, 2.5)
    np.testing.assert_array_equal(got_chosen, want_chosen)
    np.testing.assert_allclose(got_weights, want_weights, rtol=1e-5)
    ungrouped = _route_reference(logits, bias, 1, 1, 2, 2.5)[1]
    unbiased = _route_reference(logits, np.zeros_like(bias), 4, 2, 2, 2.5)[1]
    assert (ungrouped != want_chosen).any(axis=1).sum() > 0
    assert (unbiased != want_chosen).any(axis=1).sum() > 0


def test_glm4_moe_refuses_groups_that_cannot_hold_the_top_k():
    cfg = json.loads((FIXTURES / "glm4_moe" / "config.json").read_text())
    with pytest.raises(UserError, match="topk_group"):
        arch_from_hf_dict({**cfg, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3})
    with pytest.raises(UserError, match="equal groups"):
        arch_from_hf_dict({**cfg, "n_group": 3})


def test_model_config_turns_the_load_balancing_loss_on_for_a_checkpoint():
    """The checkpoint's config.json has output_router_logits false; model_config's true and coefficient
    reach the loaded model's loss (train/setup.py), which then adds coef x aux per token."""
    from bmtrain_cli.models.moe import with_aux_loss_settings

    ref = _ref("qwen3_moe")
    ids, labels = paddle.to_tensor(ref["input_ids"]), paddle.to_tensor(ref["labels"])
    model = load_pretrained(FIXTURES / "qwen3_moe")
    assert not model.arch.output_router_logits
    plain, count = model.loss_sum(ids, labels)
    settings = ModelConfig(output_router_logits=True, router_aux_loss_coef=0.5)
    model = with_aux_loss_settings(model, settings)
    assert model.arch.output_router_logits and model.arch.router_aux_loss_coef == 0.5
    total, _ = model.loss_sum(ids, labels)
    aux = float(model.last_aux_loss)
    np.testing.assert_allclose(float(total), float(plain) + 0.5 * aux * float(count), rtol=1e-6)
    assert aux > 0
