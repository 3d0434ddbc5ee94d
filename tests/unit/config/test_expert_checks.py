"""validate-config for parallel_config.expert_parallel: the expert ranks are data ranks (they count in the
world size and in the global batch), and the layouts parallel/expert_parallel.py cannot run are refused at
the key's file:line with the reason, before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError

MODEL = (
    "model_config:\n  family: {family}\n  hidden_size: 64\n  num_attention_heads: 4\n"
    "  num_experts: {experts}\n  num_experts_per_tok: 2\n  moe_intermediate_size: 32\n{model}"
)
TRAIN = "train_config:\n  demo_data: arithmetic\n  micro_batch_size: 1\n  global_batch_size: {batch}\n{train}"
PARALLEL = "parallel_config:\n  expert_parallel: {ep}\n{parallel}"


def _text(experts: object = 4, model="", train="", ep=2, parallel="", family="qwen3_moe", batch=4) -> str:
    head = MODEL.format(experts=experts, model=model, family=family)
    if experts is None:  # a dense model
        head = "".join(line for line in head.splitlines(True) if "expert" not in line)
    return head + TRAIN.format(train=train, batch=batch) + PARALLEL.format(ep=ep, parallel=parallel)


def test_expert_ranks_are_data_ranks(write_yaml):
    cfg = load_config(write_yaml(_text(parallel="  data_parallel: 2\n")), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.data_ranks == 4
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(_text()), world_size=4)
    assert "expert 2 = 2) does not match the 4 launched processes" in str(info.value)
    with pytest.raises(ConfigError, match="expert_parallel 2\\), so it must be a multiple of 2"):
        load_config(write_yaml(_text(batch=3)))


def test_expert_parallel_admits_dpo_and_adapters_on_the_experts(write_yaml):
    """DPO (its reference forwards dispatch in step on every rank) and LoRA on the experts' projections
    (each rank holds its experts' adapters) run under expert parallel (tests/integration/test_expert_methods.py)."""
    lora = _text(train="  finetuning: lora\n  lora_target_modules: all-linear\n")
    assert load_config(write_yaml(lora), world_size=2).config.train.lora_target_modules == "all-linear"
    checkpoint = Path(__file__).parents[2] / "fixtures" / "hf" / "qwen3_moe"
    dpo = (
        f"model_config:\n  model_name_or_path: {checkpoint}\n"
        "train_config:\n  stage: dpo\n  demo_data: reverse\n  micro_batch_size: 1\n  global_batch_size: 4\n"
        "parallel_config:\n  expert_parallel: 2\n  tensor_parallel: 2\n"
    )
    assert load_config(write_yaml(dpo), world_size=4).config.train.stage == "dpo"


@pytest.mark.parametrize("beside", ["data_parallel", "tensor_parallel", "context_parallel"])
@pytest.mark.parametrize("finetuning", ["full", "lora"])
def test_expert_parallel_admits_grpo(write_yaml, finetuning, beside):
    """GRPO under expert parallel, beside data, tensor or context parallel: the rollouts decode in step over
    the expert group (models/generate.py) and every log-prob pass runs the same micro-batches on every rank;
    LoRA's reference (the policy with its adapters off) dispatches in step too, so nothing is precomputed
    (tests/integration/test_grpo_parallel.py; docs/parallel.md)."""
    checkpoint = Path(__file__).parents[2] / "fixtures" / "hf" / "qwen3_moe"
    text = f"model_config:\n  model_name_or_path: {checkpoint}\n  max_seq_len: 32\n" + (
        f"train_config:\n  stage: grpo\n  demo_data: reverse\n  finetuning: {finetuning}\n"
        "  micro_batch_size: 2\n  global_batch_size: 16\n  grpo:\n    num_generations: 4\n    beta: 0.05\n"
        "    max_completion_length: 8\n    reward_funcs: [overlong]\n"
        f"parallel_config:\n  expert_parallel: 2\n  {beside}: 2\n"
    )
    cfg = load_config(write_yaml(text), world_size=4).config
    assert (
        cfg.train.stage == "grpo" and cfg.parallel.expert_parallel == 2 and cfg.train.finetuning == finetuning
    )


def test_expert_parallel_admits_a_quantised_base(write_yaml):
    """QLoRA under expert parallel: each rank quantises its own experts (tests/integration/
    test_expert_parallel.py runs it against one process)."""
    text = _text(
        model="  quantization:\n    method: nf4\n",
        train="  finetuning: lora\n  lora_target_modules: all-linear\n",
    )
    cfg = load_config(write_yaml(text), world_size=2).config
    assert cfg.model.quantization is not None and cfg.parallel.expert_parallel == 2


def test_expert_parallel_composes_with_pipeline_parallel(write_yaml):
    cfg = load_config(write_yaml(_text(parallel="  pipeline_parallel: 2\n")), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.data_ranks == 2


def test_expert_parallel_composes_with_context_parallel(write_yaml):
    """ep2 x cp2 (tests/integration/test_context_parallel.py): four ranks; the two ranks of a context
    group read one batch and dispatch their shares' rows to each other's experts."""
    text = _text(model="  output_router_logits: true\n", parallel="  context_parallel: 2\n", batch=2)
    cfg = load_config(write_yaml(text), world_size=4).config
    assert cfg.parallel.world_size == 4 and cfg.parallel.context_parallel == 2


@pytest.mark.parametrize(
    "kwargs, line, message",
    [
        (
            {"experts": 6, "ep": 4},
            13,
            "the 6 experts of every MoE layer do not split evenly over expert_parallel 4",
        ),
        ({"family": "llama", "experts": None}, 11, "needs a mixture-of-experts model; llama has no experts"),
        (
            {"family": "glm4_moe", "parallel": "  tensor_parallel: 3\n"},
            14,
            "shared experts' width (32) is not divisible by tensor_parallel (3)",
        ),
        (
            {"parallel": "  sharding_parallel: 2\n"},
            14,
            "expert parallel does not support sharding_parallel > 1",
        ),
        (
            {"parallel": "  gradient_compression: int8\n  data_parallel: 2\n"},
            14,
            "does not compress gradients",
        ),
        (
            {"train": "  stage: dpo\n  finetuning: lora\n"},
            8,
            "expert parallel with LoRA scores the held-out pairs' reference",
        ),
    ],
)
def test_refused_at_file_line(write_yaml, kwargs, line, message):
    path = write_yaml(_text(**kwargs))
    with pytest.raises(ConfigError) as info:
        load_config(path, has_gpu=False)
    errors = [(p.file, p.line, p.message) for p in info.value.problems if p.severity == "error"]
    assert any((f, n) == (str(path), line) and message in text for f, n, text in errors), errors


@pytest.mark.parametrize("aux", [False, True])
@pytest.mark.parametrize("ep", [1, 2])
def test_dpo_under_pipeline_parallel_on_a_mixture_of_experts(write_yaml, aux, ep):
    """Preference pairs run through the pipeline on an MoE policy, expert parallel beside or not, with the
    load-balancing loss (the stages carry the routers' sums to the pair loss) or without
    (tests/integration/test_expert_parallel.py), and beside context parallel (the last stage sums the
    shares' log-probs over the context group)."""
    checkpoint = Path(__file__).parents[2] / "fixtures" / "hf" / "qwen3_moe"
    text = (
        f"model_config:\n  model_name_or_path: {checkpoint}\n  output_router_logits: {str(aux).lower()}\n"
        "  max_seq_len: 32\n"
        "train_config:\n  stage: dpo\n  demo_data: reverse\n  micro_batch_size: 1\n  global_batch_size: 4\n"
        "  precompute_ref_log_probs: true\n  finetuning: lora\n"
        f"parallel_config:\n  pipeline_parallel: 2\n  expert_parallel: {ep}\n"
    )
    cfg = load_config(write_yaml(text), world_size=2 * ep).config
    assert cfg.parallel.pipeline_parallel == 2 and cfg.model.output_router_logits is aux
    with_cp = load_config(write_yaml(text + "  context_parallel: 2\n"), world_size=4 * ep).config
    assert with_cp.parallel.context_parallel == 2
