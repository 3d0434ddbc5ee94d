"""`bmtrain plan --search` over expert parallel (no Paddle needed): on an MoE config it weighs expert
parallel against the other axes and lists only layouts `validate-config` accepts; a dense model gets no
expert axis; the step-time model charges the all-to-alls and reduces the experts' gradients over their
replica group only."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.config.layout_admission import AXES, layout_admission
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.estimator import Layout, Workload
from bmtrain_cli.plan.search import enumerate_layouts, layout_axes, search, step_time

MOE_CONFIG = "configs/qwen3-30b-a3b-lora-ep8.yaml"
DENSE_CONFIG = "configs/qwen2.5-7b-sft.yaml"
CP, EP = AXES.index("context_parallel"), AXES.index("expert_parallel")
A100 = get_device("A100-80GB")


def _overrides(layout: Layout) -> list:
    return [f"parallel_config.{k}={v}" for k, v in zip(AXES, layout_axes(layout))] + [
        f"train_config.micro_batch_size={layout.micro_batch}"
    ]


@pytest.fixture
def moe(repo_root):
    loaded = load_config(str(repo_root / MOE_CONFIG), [], mode="validate", has_gpu=True)
    return loaded, Workload.from_config(loaded.config)


def test_moe_search_weighs_expert_parallel_and_lists_only_valid_layouts(moe, repo_root) -> None:
    loaded, w = moe
    admits = layout_admission(loaded.config, has_gpu=True)
    found = search(w, A100, gpus=8, top=200, admits=admits)
    ranked = found["ranked"]
    assert found["best"] is not None and ranked
    assert {c.layout.ep for c in ranked} >= {2, 4, 8}  # every degree that splits 128 experts over 8 GPUs
    assert any(c.breakdown["expert_parallel_comm"] > 0 for c in ranked)
    # each proposal loads through validate-config's checks, set as a user would set it
    for c in ranked:
        load_config(str(repo_root / MOE_CONFIG), _overrides(c.layout), mode="validate", has_gpu=True)
    # expert beside context parallel is a layout validate-config admits: the search weighs it
    both = [
        lay for lay in enumerate_layouts(w, 8, A100) if layout_axes(lay)[CP] > 1 and layout_axes(lay)[EP] > 1
    ]
    assert both and all(admits(layout_axes(lay)) for lay in both)
    # the enumeration holds layouts the checks refuse (context parallel on rows of 4098 tokens, which do not
    # split into 2 x context_parallel equal chunks): the filter, not a copy of the rules, keeps them out
    odd = ["model_config.max_seq_len=4098"]
    config = load_config(str(repo_root / MOE_CONFIG), odd, mode="validate", has_gpu=True).config
    admits = layout_admission(config, has_gpu=True)
    refused = [lay for lay in enumerate_layouts(w, 8, A100) if not admits(layout_axes(lay))]
    assert refused and all(layout_axes(lay)[CP] > 1 for lay in refused)
    ranked = search(w, A100, gpus=8, top=200, admits=admits)["ranked"]
    assert ranked and not {layout_axes(lay) for lay in refused} & {layout_axes(c.layout) for c in ranked}


def test_a_dense_model_gets_no_expert_axis(repo_root) -> None:
    loaded = load_config(str(repo_root / DENSE_CONFIG), [], mode="validate", has_gpu=True)
    w = Workload.from_config(loaded.config)
    assert all(lay.ep == 1 for lay in enumerate_layouts(w, 8, A100))
    assert not layout_admission(loaded.config, has_gpu=True)((4, 1, 1, 1, 1, 1, 2))


def test_expert_parallel_step_time_terms(moe) -> None:
    """The all-to-all grows with the degree's share of rows that leave a rank; full fine-tuning reduces the
    routed experts' gradients over dp (their replica group), not over every data rank; the compute counts
    the active parameters (the top-k experts), so it does not depend on the expert split."""
    _, w = moe
    full = replace(w, finetuning="full")
    t2 = step_time(full, Layout(dp=4, ep=2), A100)
    t8 = step_time(full, Layout(dp=1, ep=8), A100)
    plain = step_time(full, Layout(dp=8), A100)
    assert t2["compute"] == t8["compute"] == plain["compute"]
    assert 0 < t2["expert_parallel_comm"] < t8["expert_parallel_comm"]
    assert plain["expert_parallel_comm"] == 0
    # ep 8 has no expert replicas to reduce over: only the non-expert gradients travel
    assert t8["data_parallel_comm"] < t2["data_parallel_comm"] < plain["data_parallel_comm"]
