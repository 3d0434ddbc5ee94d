"""The planner on a mixture of experts (plan/moe_memory.py): a stage's parameters are the model's (every
expert, the router, the shared experts, the dense layers), LoRA on the experts counts each expert's
adapters as the built model has them, the kept activations grow with the routed rows, and `bmtrain plan`
says total and active parameters, the router and the dispatch buffers. (Predicted against measured
peaks: the moe cases of plan/calibration.py, tests/unit/plan/test_calibration.py.)"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.models.arch import arch_from_hf_dict
from bmtrain_cli.models.param_count import count_active_parameters, count_parameters, sparse_layers
from bmtrain_cli.plan import moe_memory
from bmtrain_cli.plan.activations import layer_params

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
FAMILIES = ("qwen3_moe", "mixtral", "ernie4_5_moe", "glm4_moe", "deepseek_v3")


def _arch(name):
    return arch_from_hf_dict(json.loads((FIXTURES / name / "config.json").read_text()))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_layers_parameters_add_up_to_the_model(name):
    arch = _arch(name)
    mats, vecs = layer_params(arch, 1)
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    outside = arch.vocab_size * arch.hidden_size + head + arch.hidden_size
    # per-layer means in whole elements: within one element per layer of the exact count
    planned = arch.num_hidden_layers * (mats + vecs) + outside
    assert abs(planned - count_parameters(arch)) <= 2 * arch.num_hidden_layers + arch.num_experts * 3
    assert count_active_parameters(arch) < count_parameters(arch)


@pytest.mark.parametrize(
    "targets", [["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"], "all-linear"]
)
def test_lora_on_the_experts_counts_every_experts_adapters(targets):
    from bmtrain_cli.lora.inject import apply_lora, trainable_count
    from bmtrain_cli.models import load_pretrained

    for name in ("qwen3_moe", "ernie4_5_moe"):  # a dense first layer; ERNIE with a shared expert
        model = load_pretrained(FIXTURES / name)
        settings = SimpleNamespace(
            lora_rank=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=targets, seed=0
        )
        apply_lora(model, settings)
        per_layer = moe_memory.lora_params(model.arch, 4, targets, 1)
        assert (
            abs(model.arch.num_hidden_layers * per_layer - trainable_count(model))
            < model.arch.num_hidden_layers
        )


def test_kept_activations_follow_the_routed_rows():
    arch = _arch("qwen3_moe")
    dense = replace(arch, num_experts=0)
    grouped = moe_memory.mlp_kept_elems(arch, True, 1)
    assert moe_memory.mlp_kept_elems(arch, False, 1) > grouped  # the composition keeps the SwiGLU output
    top4 = moe_memory.mlp_kept_elems(replace(arch, num_experts_per_tok=4), True, 1)
    sparse = arch.num_hidden_layers - len(arch.mlp_only_layers)
    # two more routed rows per token: 2 x (2 hidden + 2 expert widths) + 12 routing entries, per sparse layer
    per_row = 2 * arch.hidden_size + 2 * arch.moe_intermediate_size + 6
    assert np.isclose(top4 - grouped, 2 * per_row * sparse / arch.num_hidden_layers)
    assert moe_memory.mlp_kept_elems(dense, True, 1) == 3 * dense.intermediate_size


def test_bmtrain_plan_says_total_and_active_parameters_and_the_dispatch_buffers(tmp_path):
    quickstart = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    sets = [
        "model_config.family=qwen3_moe",
        "model_config.num_experts=8",
        "model_config.moe_intermediate_size=96",
    ]
    args = ["plan", "--config", str(quickstart), "--device", "cpu"] + [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if "mixture of experts" in x)
    total, active = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) (?:parameters|active)", line))
    # the quickstart's 2 layers, both sparse: 6 of the 8 experts (width 96, hidden 128) idle per token
    assert total - active == 2 * 6 * 3 * 128 * 96
    assert f"router of {128 * 8:,} and experts of {3 * 128 * 96 * 8:,}" in line and "dispatch buffers" in line


@pytest.mark.parametrize("name", ("qwen3_moe", "deepseek_v3"))
def test_expert_parallel_keeps_a_ranks_share_of_the_routed_experts(name):
    """Under expert_parallel 2 a rank holds the router, the shared experts, the dense layers and half of
    every sparse layer's routed experts (parallel/expert_parallel.py drops the others): the plan's layer
    parameters add up to what rank 0 of the built model keeps."""
    from bmtrain_cli.models import load_pretrained

    model = load_pretrained(FIXTURES / name)
    arch = model.arch
    kept = re.compile(r"\.mlp\.experts\.(\d+)\.")
    held = sum(
        int(p.numel())
        for n, p in model.named_parameters()
        if (m := kept.search(n)) is None or int(m.group(1)) < arch.num_experts // 2
    )
    mats, vecs = layer_params(arch, 1, ep=2)
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    planned = (
        arch.num_hidden_layers * (mats + vecs) + arch.vocab_size * arch.hidden_size + head + arch.hidden_size
    )
    assert held < count_parameters(arch)
    assert abs(planned - held) <= 2 * arch.num_hidden_layers + arch.num_experts * 3


@pytest.mark.parametrize("name, width, split", [("deepseek_v3", 48, True), ("glm4_moe", 33, False)])
def test_the_search_proposes_tensor_parallel_where_it_splits_the_model(repo_root, name, width, split):
    """Tensor parallel splits a mixture of experts' attention and shared experts (routed experts whole):
    the search proposes tp2 unless the shared experts' width is odd, as validate-config refuses it."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.devices import get_device
    from bmtrain_cli.plan.search import enumerate_layouts
    from bmtrain_cli.plan.workload import Workload

    w = Workload.from_config(
        load_config(str(repo_root / "configs" / "quickstart.yaml")).config, read_data=False
    )
    arch = replace(_arch(name), moe_intermediate_size=width)
    degrees = {lay.tp for lay in enumerate_layouts(replace(w, arch=arch), 2, get_device("A100-80GB"))}
    assert 1 in degrees and (2 in degrees) == split


def test_a_frozen_reference_under_expert_parallel_holds_what_its_recipe_keeps(write_yaml):
    """Stage grpo's frozen reference has its experts split as the policy's (recipes/grpo.py: its forwards
    dispatch in step), so it weighs the rank's share of the parameters; stage dpo's holds every expert on
    each rank (recipes/dpo.py: it runs without dispatch), the share plus the experts the rank leaves out."""
    from bmtrain_cli.config import load_config
    from bmtrain_cli.plan.estimator import estimate

    arch = _arch("qwen3_moe")
    method = {
        "grpo": "  grpo:\n    beta: 0.05\n    num_generations: 4\n    max_completion_length: 8\n"
        "    reward_funcs: [overlong]\n",
        "dpo": "",
    }
    plans = {}
    for stage, extra in method.items():
        for ep in (1, 2):
            text = (
                f"model_config:\n  model_name_or_path: {FIXTURES / 'qwen3_moe'}\n  max_seq_len: 32\n"
                f"train_config:\n  stage: {stage}\n  demo_data: reverse\n  micro_batch_size: 2\n"
                f"  global_batch_size: 8\n{extra}parallel_config:\n  expert_parallel: {ep}\n"
            )
            config = load_config(write_yaml(text), world_size=ep).config
            plans[stage, ep] = estimate(config, "cpu", read_data=False)
    expert_bytes = arch.hidden_size * arch.moe_intermediate_size * 3 * 4  # one expert's fp32 weights
    unheld = sparse_layers(arch) * arch.num_experts // 2 * expert_bytes  # half of each sparse layer's
    for stage in method:
        one, two = plans[stage, 1], plans[stage, 2]
        assert one.reference_weights == one.parameters > 0
        assert abs(one.parameters - two.parameters - unheld) <= 64 * arch.num_hidden_layers, stage
    assert plans["grpo", 2].reference_weights == plans["grpo", 2].parameters
    assert plans["dpo", 2].reference_weights == plans["dpo", 1].reference_weights
