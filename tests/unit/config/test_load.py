"""Config loading: schema, overrides, error forms with file:line:column and suggestions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bmtrain_cli.config import derive, load_config
from bmtrain_cli.errors import ConfigError


def problems_of(path, overrides=(), **kw):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, **kw)
    return info.value.problems, str(info.value)


def test_defaults_from_few_lines(write_yaml):
    cfg = load_config(write_yaml("train_config:\n  learning_rate: 1.0e-4\n")).config
    assert cfg.train.learning_rate == 1e-4
    assert cfg.train.lr_scheduler == "cosine"
    assert cfg.parallel.world_size == 1
    assert cfg.model.family == "llama"


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "{}\n"])
def test_empty_file_is_refused(write_yaml, text):
    """An empty file validated as "OK" (all defaults, no data): it is refused, saying it is empty."""
    with pytest.raises(ConfigError, match="the config file is empty"):
        load_config(write_yaml(text))
    assert load_config(None).config.train.micro_batch_size == 1  # the defaults alone stay available
    # an empty file completed by --set overrides is a config
    assert load_config(write_yaml(text), ["train_config.max_steps=3"]).config.train.max_steps == 3


def test_parallel_short_form_is_synonym(write_yaml):
    text = "parallel:\n  data_parallel: 4\n  tensor_parallel: 2\n  pipeline_parallel: 1\n"
    cfg = load_config(write_yaml(text)).config
    assert cfg.parallel.data_parallel == 4 and cfg.parallel.tensor_parallel == 2
    assert cfg.parallel.world_size == 8
    assert cfg.to_dict()["parallel_config"]["tensor_parallel"] == 2


def test_both_parallel_forms_refused(write_yaml):
    probs, text = problems_of(
        write_yaml("parallel:\n  data_parallel: 2\nparallel_config:\n  data_parallel: 2\n")
    )
    assert "both `parallel` and `parallel_config`" in text
    assert probs[0].line == 1


def test_both_parallel_forms_still_report_every_other_problem(write_yaml):
    probs, text = problems_of(
        write_yaml(
            "parallel:\n  data_parallel: 2\nparallel_config:\n  tensor_parallel: 3\n"
            "modle_config:\n  family: llama\n"
        )
    )
    assert "both `parallel` and `parallel_config`" in text
    assert "unknown key 'modle_config' (did you mean model_config?)" in text
    assert "num_attention_heads (4) is not divisible by tensor_parallel (3)" in text


def test_unknown_key_with_suggestion_and_position(write_yaml):
    path = write_yaml("parallel_config:\n  data_parallel: 2\n  tensor_paralel: 2\n")
    probs, text = problems_of(path)
    (p,) = probs
    assert p.path == "parallel_config.tensor_paralel"
    assert (p.line, p.column) == (3, 3)
    assert p.suggestion == "did you mean tensor_parallel?"
    assert f"{path}:3:3" in text


def test_unknown_section(write_yaml):
    probs, _ = problems_of(write_yaml("modle_config:\n  family: llama\n"))
    assert probs[0].suggestion == "did you mean model_config?"


def test_wrong_type_names_value_place(write_yaml):
    probs, _ = problems_of(write_yaml("train_config:\n  micro_batch_size: four\n"))
    (p,) = probs
    assert p.path == "train_config.micro_batch_size"
    assert (p.line, p.column) == (2, 21)
    assert "valid integer" in p.message and "'four'" in p.message


def test_literal_typo_suggests(write_yaml):
    probs, _ = problems_of(write_yaml("model_config:\n  kernels: custon\n"))
    assert probs[0].suggestion == "did you mean 'custom'?"


def test_every_problem_reported_at_once(write_yaml):
    text = (
        "model_config:\n  hidden_sizee: 3\ntrain_config:\n  max_steps: 10\n  warmup_steps: 20\n"
        "parallel_config:\n  sharding_stage: 3\n  pipeline_parallel: 2\n"
    )
    probs, _ = problems_of(write_yaml(text))
    paths = {p.path for p in probs}
    assert {
        "model_config.hidden_sizee",
        "train_config.warmup_steps",
        "parallel_config.sharding_stage",
    } <= paths


def test_malformed_yaml_has_line_and_column(write_yaml):
    probs, text = problems_of(write_yaml("model_config:\n  family: llama\n   bad: [\n"))
    assert probs[0].line == 3 and probs[0].column is not None
    assert "invalid YAML" in text


def test_unsafe_tag_refused(write_yaml):
    probs, text = problems_of(write_yaml('model_config: !!python/object/apply:os.system ["echo pwned"]\n'))
    assert "unsafe" in text and probs[0].line == 1


def test_duplicate_key_refused(write_yaml):
    probs, text = problems_of(write_yaml("train_config:\n  seed: 1\n  seed: 2\n"))
    assert "duplicate key 'seed'" in text and probs[0].line == 3


def test_non_mapping_file(write_yaml):
    _, text = problems_of(write_yaml("- a\n- b\n"))
    assert "must be a mapping" in text


def test_section_must_be_mapping(write_yaml):
    probs, _ = problems_of(write_yaml("train_config: 5\n"))
    assert probs[0].path == "train_config" and "mapping" in probs[0].message


def test_missing_file():
    probs, _ = problems_of("/nonexistent/config.yaml")
    assert "not found" in probs[0].message


def test_overrides_apply_and_parse_types(write_yaml):
    path = write_yaml("train_config:\n  max_steps: 100\n")
    cfg = load_config(
        path,
        ["train_config.max_steps=7", "parallel.data_parallel=2", "train_config.data_path=[a.jsonl, b.jsonl]"],
    ).config
    assert cfg.train.max_steps == 7
    assert cfg.parallel.data_parallel == 2
    assert cfg.train.data_path == ["a.jsonl", "b.jsonl"]


def test_override_errors_name_the_override(write_yaml):
    probs, text = problems_of(write_yaml(""), ["train_config.max_stepz=3"])
    assert probs[0].file.startswith("--set train_config.max_stepz=3")
    assert "did you mean max_steps?" in text
    _, text = problems_of(write_yaml(""), ["no_equals_sign"])
    assert "expected key.path=value" in text


def test_config_is_frozen(write_yaml):
    cfg = load_config(write_yaml("train_config:\n  max_steps: 3\n")).config
    with pytest.raises(ValidationError):
        cfg.train.learning_rate = 1.0  # type: ignore[misc]


def test_derived_values(write_yaml):
    text = "train_config:\n  micro_batch_size: 2\n  global_batch_size: 64\n  learning_rate: 1.0e-4\n  scale_lr: true\n"
    text += "parallel_config:\n  data_parallel: 4\n  tensor_parallel: 2\n"
    d = derive(load_config(write_yaml(text)).config)
    assert d.grad_accum_steps == 8 and d.world_size == 8 and d.global_batch_size == 64
    assert d.learning_rate == pytest.approx(1e-4 * 64 / 256)


def test_section_level_error_gives_no_false_cross_field_problems(write_yaml):
    # a whole-section error (data_weights vs data_path) must not be followed by checks run on that
    # section's defaults ("no training data" although data_path is set)
    path = write_yaml("train_config:\n  data_path: [a.jsonl, b.jsonl]\n  data_weights: [1, 2, 3]\n")
    probs, text = problems_of(path, ["parallel_config.tensor_parallel=3"], mode="train")
    assert "data_weights has 3 entries but data_path has 2" in text
    assert "no training data" not in text
    assert "num_attention_heads (4) is not divisible by tensor_parallel (3)" in text


def test_boolean_for_a_number_is_refused(write_yaml):
    # pydantic's lax mode would read `data_parallel: yes` as 1
    probs, text = problems_of(write_yaml("parallel_config:\n  data_parallel: yes\n"))
    (p,) = probs
    assert p.path == "parallel_config.data_parallel" and p.line == 2
    assert "got the boolean true" in text
    # boolean fields and fields that take a boolean among other values still do
    cfg = load_config(write_yaml("train_config:\n  gradient_checkpointing: yes\n")).config
    assert cfg.train.gradient_checkpointing is True


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + f"\ntrain_config:\n  data_path: *a{levels - 1}\n"


def test_alias_bomb_is_refused_quickly(write_yaml):
    """Nine levels of nine aliases expand to 9**9 values: the loader grew past 15 GB on it."""
    import time

    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(_alias_bomb()))
    assert time.monotonic() - start < 5
    assert "aliases expand to more than 100,000 values" in str(info.value)
    assert info.value.problems[0].line is not None
    # a few honest aliases (the same value reused) stay fine
    text = "train_config:\n  data_path: &d [a.jsonl, b.jsonl]\n  eval_data_path: *d\n"
    assert load_config(write_yaml(text)).config.train.eval_data_path == ["a.jsonl", "b.jsonl"]


@pytest.mark.parametrize(
    "text, reason",
    [
        ("train_config:\n  data_path: &r [*r]\n", "recursive alias"),
        ("a: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
    ],
)
def test_recursive_and_deep_yaml_is_refused(write_yaml, text, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(write_yaml(text))


@pytest.mark.parametrize(
    "line, message",
    [
        ("seed: -1", "greater than or equal to 0"),
        ("seed: 4294967296", "less than or equal to 4294967295"),
        ("learning_rate: .inf", "finite number"),
        ("min_lr: .nan", "finite number"),
        ("adam_epsilon: .inf", "finite number"),
        ("weight_decay: .inf", "finite number"),
        ("max_grad_norm: .inf", "finite number"),
        ("max_grad_norm: -1", "greater than or equal to 0"),
        ("data_weights: [1.0, .inf]\n  data_path: [a.jsonl, b.jsonl]", "finite number"),
    ],
)
def test_out_of_range_values_are_refused_with_their_line(write_yaml, line, message):
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(f"train_config:\n  {line}\n"))
    assert message in str(info.value) and info.value.problems[0].line == 2


def test_a_refused_field_is_not_judged_again_by_its_default_in_cross_field_checks(write_yaml):
    """learning_rate .inf is refused; min_lr must not then be reported as exceeding the default lr."""
    path = write_yaml("train_config:\n  learning_rate: .inf\n  min_lr: 3.0e-4\n  demo_data: arithmetic\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p.path for p in info.value.problems] == ["train_config.learning_rate"]
    path = write_yaml("train_config:\n  learning_rate: 1.0e-4\n  min_lr: 3.0e-4\n  demo_data: arithmetic\n")
    with pytest.raises(ConfigError, match="min_lr"):  # the cross-field check still runs on real values
        load_config(path)
