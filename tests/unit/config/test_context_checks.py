"""validate-config for parallel_config.context_parallel: the world size counts the context degree, and
what the ring attention cannot run yet is refused at the key's file:line with the reason."""

from __future__ import annotations

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError

MODEL = "model_config:\n  hidden_size: 64\n  num_attention_heads: 4\n  max_seq_len: {seq}\n{model}"
TRAIN = "train_config:\n  demo_data: arithmetic\n{train}"
PARALLEL = "parallel_config:\n  context_parallel: {cp}\n{parallel}"


MOE_AUX = "  family: qwen3_moe\n  num_experts: 4\n  num_experts_per_tok: 2\n  moe_intermediate_size: 32\n  output_router_logits: true\n"


def _text(seq=256, model="", train="", cp=2, parallel="") -> str:
    return (
        MODEL.format(seq=seq, model=model)
        + TRAIN.format(train=train)
        + PARALLEL.format(cp=cp, parallel=parallel)
    )


def test_context_parallel_counts_in_the_world_size(write_yaml):
    cfg = load_config(write_yaml(_text(parallel="  data_parallel: 2\n")), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.data_ranks == 2
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(_text(cp=4)), world_size=2)
    assert "context 4 = 4) does not match the 2 launched processes" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, line, message",
    [
        ({"seq": 250}, 4, "not divisible by 2 x context_parallel (4)"),
        ({"cp": 3, "seq": 256}, 4, "not divisible by 2 x context_parallel (6)"),
        (
            {"model": "  num_key_value_heads: 1\n", "parallel": "  context_parallel_mode: ulysses\n"},
            10,
            "a rank holds 1 (1 KV heads / tensor_parallel 1) for 4 query heads: not divisible by context_parallel 2",
        ),
        ({"parallel": "  sharding_parallel: 2\n  sharding_stage: 2\n"}, 10, "sharding_stage 2 yet"),
        ({"train": "  to_static: true\n"}, 7, "to_static cannot run the ring"),
        ({"model": "  family: baichuan\n  position_embedding: alibi\n"}, 10, "ALiBi"),
        ({"model": "  family: qwen3_5_text\n"}, 9, "linear-attention layers"),
    ],
)
def test_refused_at_file_line(write_yaml, kwargs, line, message):
    path = write_yaml(_text(**kwargs))
    with pytest.raises(ConfigError) as info:
        load_config(path, has_gpu=False)
    text = str(info.value)
    assert message in text, text
    assert any(f"{path}:{line}:" in row and message in row for row in text.splitlines()), text


def test_tensor_parallel_composes(write_yaml):
    """tp2 x cp2: four ranks, the context groups inside fleet's data axis beside the tensor groups."""
    text = _text(parallel="  tensor_parallel: 2\n")
    cfg = load_config(write_yaml(text), world_size=4, has_gpu=False).config
    assert cfg.parallel.world_size == 4
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(text), world_size=2, has_gpu=False)
    assert "tensor 2 x pipeline 1 x sharding 1 x context 2 = 4) does not match the 2" in str(info.value)


def test_a_context_group_of_a_gloo_world_checks_the_group_layout(write_yaml):
    """tp2 x cp4 (8 ranks) needs data groups of 4 inside a world of 8: the CPU build refuses it before
    launch (gloo cannot connect such a group); a GPU build accepts it."""
    path = write_yaml(_text(cp=4, parallel="  tensor_parallel: 2\n"))
    with pytest.raises(ConfigError) as info:
        load_config(path, mode="train", has_gpu=False, world_size=8)
    assert f"{path}:8:" in str(info.value) and "groups of 4 (data)" in str(info.value)
    assert load_config(path, mode="train", has_gpu=True, world_size=8).config.parallel.world_size == 8


def test_pipeline_parallel_composes_for_sft(write_yaml):
    cfg = load_config(write_yaml(_text(parallel="  pipeline_parallel: 2\n")), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.data_ranks == 1


def test_sharding_stage_1_composes(write_yaml):
    cfg = load_config(write_yaml(_text(parallel="  sharding_parallel: 2\n")), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.data_ranks == 2


@pytest.mark.parametrize("has_gpu", [False, True])
def test_ulysses_runs_where_the_heads_divide(write_yaml, has_gpu):
    """The all-to-all exists on both builds (NCCL's; on gloo the pairwise exchange of cpu_compat); the KV
    heads of a tensor rank must divide by the context degree: 4 / tp2 = 2 for cp2, not for cp4."""
    mode = "  context_parallel_mode: ulysses\n  tensor_parallel: 2\n"
    cfg = load_config(write_yaml(_text(parallel=mode)), world_size=4, has_gpu=has_gpu).config
    assert cfg.parallel.context_parallel_mode == "ulysses"
    with pytest.raises(ConfigError, match="a rank holds 2 .4 KV heads / tensor_parallel 2."):
        load_config(write_yaml(_text(cp=4, parallel=mode)), world_size=8, has_gpu=True)


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize(
    "model",
    [
        "  family: mistral\n  sliding_window: 64\n",
        "  family: mistral\n  sliding_window: 4096\n",
        "  family: gemma3_text\n  num_key_value_heads: 2\n  sliding_window: 32\n",
        "  family: gemma2\n  num_key_value_heads: 2\n  sliding_window: 32\n",
    ],
)
def test_sliding_windows_pass(write_yaml, model, mode):
    """Windows shorter or longer than the rows, one for every layer (Mistral) or for the sliding layers
    (Gemma 3): the ring applies them on the tokens' places in the whole rows, ulysses over whole rows."""
    parallel = f"  context_parallel_mode: {mode}\n"
    cfg = load_config(write_yaml(_text(model=model, parallel=parallel)), has_gpu=False).config
    assert cfg.parallel.context_parallel == 2 and cfg.model.sliding_window in (32, 64, 4096)


def test_the_moe_load_balancing_loss_composes(write_yaml):
    """An MoE model with output_router_logits at cp2 (its routers' sums summed over the context group),
    beside data and pipeline parallel (the stages carry the share's sums)."""
    assert load_config(write_yaml(_text(model=MOE_AUX)), has_gpu=False).config.model.output_router_logits
    for other in ("data_parallel", "pipeline_parallel"):
        text = _text(model=MOE_AUX, parallel=f"  {other}: 2\n")
        assert load_config(write_yaml(text), world_size=4, has_gpu=False).config.parallel.world_size == 4


def test_grpo_beside_tensor_parallel_is_accepted(write_yaml):
    """GRPO under tp2 x cp2 equals one process (tests/integration/test_grpo_parallel.py)."""
    grpo = (
        "train_config:\n  stage: grpo\n  demo_data: reverse\n  micro_batch_size: 4\n  global_batch_size: 16\n"
        "  grpo:\n    num_generations: 4\n    max_completion_length: 8\n    reward_funcs: [overlong]\n"
    )
    text = MODEL.format(seq=64, model="") + grpo + PARALLEL.format(cp=2, parallel="  tensor_parallel: 2\n")
    cfg = load_config(write_yaml(text), world_size=4, has_gpu=False).config
    assert cfg.train.stage == "grpo" and cfg.parallel.tensor_parallel == cfg.parallel.context_parallel == 2
