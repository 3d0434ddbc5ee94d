"""validate-config for stage: dpo: what a preference run cannot use is refused before launch."""

from __future__ import annotations

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError

BASE = "model_config:\n  model_name_or_path: ckpt\ntrain_config:\n  stage: dpo\n  data_path: p.jsonl\n"


def _errors(write_yaml, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(text))
    return str(info.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            "parallel:\n  pipeline_parallel: 2\n",
            "stage: dpo cannot be combined with pipeline_parallel > 1 and a live reference model (dpo_loss: sigmoid)",
        ),
        (
            "  dpo_loss: ipo\nparallel:\n  pipeline_parallel: 2\n",
            "set precompute_ref_log_probs: true (computed once before training), or use dpo_loss simpo/orpo",
        ),
        (
            "  dpo_loss: orpo\n  micro_batch_size: 2\n  global_batch_size: 8\n"
            "parallel:\n  pipeline_parallel: 2\n  pipeline_micro_batches: 2\n",
            "pipeline_micro_batches (2) other than the gradient accumulation steps (4)",
        ),
        (
            "parallel:\n  sharding_parallel: 2\n  sharding_stage: 2\n",
            "cannot be combined with sharding_stage 2/3",
        ),
        ("  to_static: true\n", "cannot be combined with to_static"),
        ("  train_on_prompt: true\n", "cannot be combined with train_on_prompt"),
        ("  dpo_loss: ipo\n  dpo_label_smoothing: 0.1\n", "the ipo loss has no label smoothing"),
        ("  dpo_loss: simpo\n  precompute_ref_log_probs: true\n", "the simpo loss is reference-free"),
        ("  dpo_label_smoothing: 0.5\n", "less than 0.5"),
        ("  dpo_beta: 0\n", "greater than 0"),
        ("  dpo_loss: kto\n", "'sigmoid', 'ipo', 'simpo' or 'orpo'"),
    ],
)
def test_refused_before_launch(write_yaml, extra, message):
    assert message in _errors(write_yaml, BASE + extra)


def test_dpo_needs_a_starting_model(write_yaml):
    text = _errors(write_yaml, "train_config:\n  stage: dpo\n  data_path: p.jsonl\n")
    assert "stage: dpo starts from a trained model" in text


def test_accepted_layouts_and_unused_keys_warn(write_yaml):
    ok = BASE + "  dpo_loss: simpo\n  simpo_gamma: 1.0\nparallel:\n  tensor_parallel: 1\n  data_parallel: 2\n"
    assert load_config(write_yaml(ok)) is not None
    for pipelined in ("  dpo_loss: orpo\n", "  dpo_loss: simpo\n", "  precompute_ref_log_probs: true\n"):
        text = (
            BASE
            + pipelined
            + "  micro_batch_size: 2\n  global_batch_size: 8\nparallel:\n  pipeline_parallel: 2\n"
        )
        assert load_config(write_yaml(text)) is not None
    loaded = load_config(write_yaml("train_config:\n  dpo_beta: 0.2\n  data_path: p.jsonl\n"))
    assert any("applies to stage: dpo" in w.message for w in loaded.warnings)
    loaded = load_config(write_yaml(BASE + "  simpo_gamma: 1.0\n"))
    assert any("not used by dpo_loss: sigmoid" in w.message for w in loaded.warnings)
