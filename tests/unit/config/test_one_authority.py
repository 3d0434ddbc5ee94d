"""validate-config refuses first whatever the model builder or the schedule refuses: the cases are derived
from the builder's and the schedule's own rules (models/arch.ARCH_RULES, config/derived.schedule_problems),
so a rule added there is covered here without a new test."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import yaml

from bmtrain_cli.config import load_config
from bmtrain_cli.config.derived import derive
from bmtrain_cli.errors import ConfigError, UserError
from bmtrain_cli.models.arch import ARCH_RULES, ModelArch, arch_from_model_config


@pytest.mark.parametrize("rule", ARCH_RULES, ids=[r.field for r in ARCH_RULES])
def test_every_builder_rule_is_refused_by_validate_config_at_its_line(write_yaml, rule):
    text = yaml.safe_dump({"model_config": {"hidden_size": 96, **rule.example}}, sort_keys=False)
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(text))
    blamed = [p for p in info.value.problems if p.severity == "error"]
    assert any(p.path and p.path.startswith("model_config.") for p in blamed), blamed
    # the line points into model_config, where the offending key is written
    assert all(p.line is not None for p in blamed)


@pytest.mark.parametrize("rule", ARCH_RULES, ids=[r.field for r in ARCH_RULES])
def test_the_builder_refuses_the_same_examples(rule):
    from bmtrain_cli.models.decoder import CausalLM

    arch = replace(ModelArch(hidden_size=96, head_dim=24), **rule.example)
    assert rule.broken(arch)
    with pytest.raises(UserError, match=rule.field):
        CausalLM(arch, kernels="reference")


def test_gqa_4_over_3_is_refused_but_4_over_2_accepted(write_yaml):
    ok = load_config(write_yaml("model_config:\n  num_attention_heads: 4\n  num_key_value_heads: 2\n"))
    assert arch_from_model_config(ok.config.model).num_key_value_heads == 2
    with pytest.raises(ConfigError, match=r"must be a multiple of num_key_value_heads \(3\)"):
        load_config(write_yaml("model_config:\n  num_attention_heads: 4\n  num_key_value_heads: 3\n"))


CASES = list(
    itertools.product(
        (1e-5, 3e-4), (0.0, 1e-6, 2e-5), (False, True), (8, 512), ("cosine", "linear", "constant")
    )
)


@pytest.mark.parametrize("lr,min_lr,scale,batch,kind", CASES)
def test_schedule_refuses_exactly_what_validation_refuses(write_yaml, lr, min_lr, scale, batch, kind):
    from bmtrain_cli.train.optimizer.lr_schedule import build_schedule

    text = (
        f"train_config:\n  learning_rate: {lr}\n  min_lr: {min_lr}\n  scale_lr: {str(scale).lower()}\n"
        f"  global_batch_size: {batch}\n  micro_batch_size: 8\n  lr_scheduler: {kind}\n  max_steps: 20\n"
    )
    try:
        load_config(write_yaml(text))
    except ConfigError as exc:
        assert any(p.path == "train_config.min_lr" for p in exc.problems), exc.problems
        refused_by_validation = True
    else:
        refused_by_validation = False
    # the schedule itself, built from the same values without validation
    base = load_config(write_yaml(text.replace(f"min_lr: {min_lr}", "min_lr: 0.0"))).config
    t = base.train.model_copy(update={"min_lr": min_lr})
    peak = derive(base).learning_rate
    try:
        sched = build_schedule(t, peak, 20)
    except UserError:
        refused_by_schedule = True
    else:
        refused_by_schedule = False
        if kind != "constant":
            assert sched(19) >= min_lr - 1e-12  # decays to the floor, never below, never clamped upwards
    assert refused_by_validation == refused_by_schedule
    if scale and kind != "constant" and min_lr == 1e-6 and lr == 1e-5 and batch == 8:
        assert refused_by_validation  # the reported bug: 1e-5 x 8 / 256 = 3.1e-7 < 1e-6
