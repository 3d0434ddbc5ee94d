"""Each cross-field check, with its message."""

from __future__ import annotations

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError


def error_text(write_yaml, text, **kw):
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(text), **kw)
    return str(info.value), info.value.problems


def test_heads_divisible_by_tp(write_yaml):
    text, probs = error_text(
        write_yaml,
        "model_config:\n  num_attention_heads: 6\n  hidden_size: 384\nparallel:\n  tensor_parallel: 4\n",
    )
    assert "num_attention_heads (6) is not divisible by tensor_parallel (4)" in text
    assert probs[0].line == 5


def test_kv_heads_divisible_by_tp(write_yaml):
    text, _ = error_text(
        write_yaml,
        "model_config:\n  num_attention_heads: 4\n  num_key_value_heads: 1\nparallel:\n  tensor_parallel: 2\n",
    )
    assert "num_key_value_heads (1)" in text


def test_vocab_under_tp(write_yaml):
    text, _ = error_text(write_yaml, "model_config:\n  vocab_size: 32001\nparallel:\n  tensor_parallel: 2\n")
    assert "vocab_size (32001) is not divisible by tensor_parallel (2)" in text
    assert "pad the vocabulary" in text


def test_layers_vs_pipeline(write_yaml):
    text, _ = error_text(
        write_yaml, "model_config:\n  num_hidden_layers: 2\nparallel:\n  pipeline_parallel: 4\n"
    )
    assert "exceeds num_hidden_layers (2)" in text


def test_global_batch_divisibility(write_yaml):
    text, probs = error_text(
        write_yaml,
        "train_config:\n  micro_batch_size: 2\n  global_batch_size: 12\nparallel:\n  data_parallel: 4\n",
    )
    assert "must be a multiple of 8" in text and "try 8 or 16" in text
    assert probs[0].path == "train_config.global_batch_size" and probs[0].line == 3


def test_world_size_matches_launch(write_yaml):
    text, _ = error_text(write_yaml, "parallel:\n  data_parallel: 2\n  tensor_parallel: 2\n", world_size=2)
    assert "= 4) does not match the 2 launched processes" in text
    load_config(write_yaml("parallel:\n  data_parallel: 2\n"), world_size=2)


def test_warmup_shorter_than_training(write_yaml):
    text, _ = error_text(write_yaml, "train_config:\n  max_steps: 10\n  warmup_steps: 10\n")
    assert "warmup_steps (10) must be shorter than training" in text


def test_warmup_two_forms(write_yaml):
    text, _ = error_text(write_yaml, "train_config:\n  warmup_steps: 10\n  warmup_ratio: 0.1\n")
    assert "warmup_steps or warmup_ratio, not both" in text


def test_sharding_23_with_pipeline_refused(write_yaml):
    text, _ = error_text(write_yaml, "parallel_config:\n  sharding_stage: 2\n  pipeline_parallel: 2\n")
    assert "cannot be combined with pipeline_parallel" in text


def test_param_offload_needs_stage3(write_yaml):
    text, _ = error_text(write_yaml, "parallel_config:\n  offload_params: true\n")
    assert "needs sharding_stage: 3" in text


def test_bf16_without_gpu_warns_in_validate_refuses_in_train(write_yaml):
    path = write_yaml("train_config:\n  precision: bf16\n  data_path: x.jsonl\n")
    loaded = load_config(path, has_gpu=False)
    assert any("needs a GPU build of Paddle" in w.message for w in loaded.warnings)
    with pytest.raises(ConfigError) as info:
        load_config(path, mode="train", has_gpu=False)
    assert "use precision: fp32" in str(info.value)
    assert load_config(path, mode="train", has_gpu=True).warnings == []


def test_lora_unknown_target(write_yaml):
    text, _ = error_text(
        write_yaml, "train_config:\n  finetuning: lora\n  lora_target_modules: [q_proj, qq_proj]\n"
    )
    assert "unknown target module 'qq_proj'" in text and "available:" in text


def test_lora_rank_positive(write_yaml):
    text, _ = error_text(write_yaml, "train_config:\n  finetuning: lora\n  lora_rank: 0\n")
    assert "lora_rank must be > 0" in text


def test_train_requires_data(write_yaml):
    text, _ = error_text(write_yaml, "train_config:\n  max_steps: 3\n", mode="train")
    assert "no training data" in text


def test_missing_checkpoint_is_error_in_train_only(write_yaml, tmp_path):
    path = write_yaml(
        f"model_config:\n  model_name_or_path: {tmp_path / 'nope'}\ntrain_config:\n  data_path: a.jsonl\n"
    )
    assert load_config(path).warnings
    text, _ = error_text(write_yaml, open(path).read(), mode="train")
    assert "does not exist" in text


def test_lora_target_not_in_this_architecture(write_yaml):
    """validate-config refuses a projection the model does not have, as training would (not 'OK' with
    0 trainable parameters)."""
    text, _ = error_text(
        write_yaml, "train_config:\n  finetuning: lora\n  lora_target_modules: [q_proj, W_pack]\n"
    )
    assert "target module not in this model (llama): 'W_pack'" in text and "q_proj" in text
    baichuan = "model_config:\n  family: baichuan\ntrain_config:\n  finetuning: lora\n  lora_target_modules: "
    text, _ = error_text(write_yaml, baichuan + "[q_proj]\n")
    assert "not in this model (baichuan): 'q_proj'" in text and "W_pack" in text
    assert load_config(write_yaml(baichuan + "[W_pack, o_proj]\n")).config.train.lora_target_modules == [
        "W_pack",
        "o_proj",
    ]


def test_sharding_stage_2_without_gpu_warns_in_validate_refuses_in_train(write_yaml):
    path = write_yaml(
        "train_config:\n  data_path: x.jsonl\nparallel_config:\n  sharding_parallel: 2\n  sharding_stage: 2\n"
    )
    loaded = load_config(path, has_gpu=False)
    assert any("sharding_stage 2 needs a GPU build" in w.message for w in loaded.warnings)
    with pytest.raises(ConfigError) as info:
        load_config(path, mode="train", has_gpu=False)
    assert "use sharding_stage: 1" in str(info.value)
    assert load_config(path, mode="train", has_gpu=True).warnings == []


@pytest.mark.parametrize(
    "degrees,expected",
    [
        ({"data_parallel": 2, "pipeline_parallel": 3}, "3 (pipeline) and 3 (clip-check)"),
        ({"data_parallel": 2, "tensor_parallel": 2, "pipeline_parallel": 2}, "4 (clip-check)"),
        ({"data_parallel": 3, "sharding_parallel": 2}, "3 (data) and 3 (sharding-check)"),
    ],
)
def test_gloo_subgroups_of_three_or_more_are_refused_for_training_on_cpu(write_yaml, degrees, expected):
    """`bmtrain run` loads with mode="train": refused before any process starts; validate warns."""
    lines = "".join(f"  {k}: {v}\n" for k, v in degrees.items())
    text = (
        "model_config:\n  num_hidden_layers: 6\ntrain_config:\n  global_batch_size: 96\n  demo_data: arithmetic\n"
        "parallel_config:\n" + lines
    )
    path = write_yaml(text)
    msg, probs = error_text(lambda _: path, None, mode="train", has_gpu=False)
    assert f"process groups of {expected} ranks" in msg and probs[0].path == "parallel_config"
    loaded = load_config(path, has_gpu=False)  # validate: a warning only
    assert any("gloo" in w.message for w in loaded.warnings)
    load_config(path, mode="train", has_gpu=True)  # NCCL on GPUs has no such limit


def test_gloo_layouts_that_work_on_cpu_are_accepted(write_yaml):
    for degrees in (
        {"pipeline_parallel": 4},
        {"data_parallel": 2, "pipeline_parallel": 2},
        {"data_parallel": 4},
    ):
        lines = "".join(f"  {k}: {v}\n" for k, v in degrees.items())
        text = (
            "model_config:\n  num_hidden_layers: 4\ntrain_config:\n  demo_data: arithmetic\nparallel:\n"
            + lines
        )
        load_config(write_yaml(text), mode="train", has_gpu=False)


def test_vocab_size_smaller_than_the_tokenizer_is_refused(write_yaml, tmp_path):
    """A configured vocab_size below the tokenizer's used to be replaced by the tokenizer's silently."""
    from bmtrain_cli.data.tokenizers import MIN_GENERATED_VOCAB, train_sentencepiece

    text, probs = error_text(write_yaml, "model_config:\n  vocab_size: 10\n")
    assert f"vocab_size (10) is smaller than the {MIN_GENERATED_VOCAB} tokens" in text and probs[0].line == 2
    tok = train_sentencepiece(["a b c " * 50], str(tmp_path / "tok"), vocab_size=400)
    text, _ = error_text(
        write_yaml, f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n  vocab_size: 370\n"
    )
    assert f"smaller than the {tok.vocab_size} tokens of the tokenizer" in text
    # equal or larger (padding, e.g. for tensor parallel) is accepted; a checkpoint's vocabulary is its own
    load_config(
        write_yaml(f"model_config:\n  tokenizer_path: {tmp_path / 'tok'}\n  vocab_size: {tok.vocab_size}\n")
    )
    load_config(write_yaml(f"model_config:\n  vocab_size: {MIN_GENERATED_VOCAB}\n"))


def test_lora_on_a_fresh_model_warns(write_yaml):
    warnings = load_config(write_yaml("train_config:\n  finetuning: lora\n")).warnings
    assert any("LoRA on a fresh, randomly initialised model" in w.message for w in warnings)
    hf = "model_config:\n  model_name_or_path: meta-llama/Llama-2-7b-hf\ntrain_config:\n  finetuning: lora\n"
    assert not any("fresh" in w.message for w in load_config(write_yaml(hf)).warnings)


def test_shuffle_buffer_is_said_to_be_unused_without_streaming(write_yaml):
    text = "train_config:\n  streaming: false\n  shuffle_buffer: 50\n"
    warnings = load_config(write_yaml(text)).warnings
    assert [w.line for w in warnings if "shuffle_buffer" in w.path and "not used" in w.message] == [3]
    assert not load_config(write_yaml("train_config:\n  shuffle_buffer: 50\n  max_steps: 5\n")).warnings
    assert not load_config(write_yaml("train_config:\n  shuffle: false\n")).warnings


def test_streaming_without_max_steps_is_refused_before_launch(write_yaml):
    with pytest.raises(ConfigError, match="streaming.*max_steps"):
        load_config(write_yaml("train_config:\n  streaming: true\n"))
    load_config(write_yaml("train_config:\n  streaming: true\n  max_steps: 3\n  data_workers: 0\n"))


def test_pipeline_rebalance_checks(write_yaml):
    """Without pipeline parallel it does nothing (a warning: one file serves several layouts); under
    pipeline parallel it needs intermediate checkpoints, and it is refused with sharding."""
    on = "parallel:\n  pipeline_rebalance:\n    enabled: true\n"
    loaded = load_config(write_yaml("model_config:\n  num_hidden_layers: 4\n" + on))
    assert any("no effect with pipeline_parallel 1" in w.message for w in loaded.warnings)
    pp2 = "model_config:\n  num_hidden_layers: 4\n" + on + "  pipeline_parallel: 2\n"
    assert not [w for w in load_config(write_yaml(pp2)).warnings if "pipeline_rebalance" in (w.path or "")]
    text, probs = error_text(write_yaml, pp2 + "train_config:\n  save_steps: null\n")
    assert "the only checkpoint is the last one" in text and "set train_config.save_steps" in text
    assert probs[0].path.endswith("pipeline_rebalance.enabled")
    text, _ = error_text(write_yaml, pp2 + "  sharding_parallel: 2\n")
    assert "not with sharding" in text
    text, _ = error_text(write_yaml, on + "    threshold: 1.0\n")
    assert "threshold" in text
