"""validate-config for stage: grpo: the layouts a GRPO run takes (data parallel, sharding stage 1, tensor
parallel 2 alone or with data parallel 2) pass,
the others are refused before launch with their reason."""

from __future__ import annotations

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError

BASE = (
    "model_config:\n  model_name_or_path: ckpt\n  max_seq_len: 64\ntrain_config:\n  stage: grpo\n"
    "  data_path: p.jsonl\n  micro_batch_size: 4\n  grpo:\n    num_generations: 4\n"
    "    max_completion_length: 16\n    reward_funcs: [accuracy]\n"
)


def _errors(write_yaml, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(text))
    return str(info.value)


@pytest.mark.parametrize(
    "layout",
    [
        "parallel:\n  data_parallel: 2\n",
        "parallel:\n  sharding_parallel: 2\n",
        "parallel:\n  data_parallel: 2\n  sharding_parallel: 2\n",
    ],
)
def test_data_parallel_and_sharding_stage1_are_accepted(write_yaml, layout):
    assert load_config(write_yaml(BASE + layout)).config.parallel.data_ranks > 1


@pytest.mark.parametrize("dp", [1, 2])
def test_tensor_parallel_2_alone_or_with_data_parallel_2_is_accepted(write_yaml, dp):
    config = load_config(
        write_yaml(BASE + f"parallel:\n  tensor_parallel: 2\n  data_parallel: {dp}\n")
    ).config
    assert config.parallel.tensor_parallel == 2 and config.parallel.data_parallel == dp


@pytest.mark.parametrize(
    "layout, message",
    [
        (
            "parallel:\n  tensor_parallel: 2\n  sharding_parallel: 2\n",
            "tensor parallel is checked against one process at tensor_parallel 2, alone or with data_parallel 2",
        ),
        ("parallel:\n  tensor_parallel: 2\n  data_parallel: 4\n", "tensor_parallel 2 with data_parallel 4"),
        ("parallel:\n  tensor_parallel: 4\n", "tensor_parallel 4 with data_parallel 1"),
        ("parallel:\n  pipeline_parallel: 2\n", "the rollouts run the whole model on each rank"),
        (
            "parallel:\n  sharding_parallel: 2\n  sharding_stage: 2\n",
            "sharding_stage 2: the group-sharded wrapper runs only the SFT loss forward",
        ),
    ],
)
def test_other_layouts_are_refused_with_the_reason(write_yaml, layout, message):
    text = _errors(write_yaml, BASE + layout)
    assert "stage: grpo cannot be combined with" in text and message in text


def test_a_step_must_hold_whole_groups_over_all_data_ranks(write_yaml):
    """micro_batch_size 2 x 2 data ranks = 4 completions: one whole group of 4 (accepted); 3 x 2 = 6 is not."""
    small = BASE.replace("micro_batch_size: 4", "micro_batch_size: 2") + "parallel:\n  data_parallel: 2\n"
    assert load_config(write_yaml(small)) is not None
    odd = BASE.replace("micro_batch_size: 4", "micro_batch_size: 3") + "parallel:\n  data_parallel: 2\n"
    assert "do not hold whole groups of num_generations (4)" in _errors(write_yaml, odd)
