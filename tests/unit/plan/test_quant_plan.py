"""`bmtrain plan` with model_config.quantization counts the quantised base (codes and scales) in place of
its full-precision projections, a mixture of experts' experts included, plus the dequantisation
workspace: the count equals what a built quantised model holds. And what it says fits: a 7B QLoRA on one
24 GiB GPU, a 30B mixture of experts (Qwen3-30B-A3B's shape) on one 80 GiB GPU."""

from __future__ import annotations

from bmtrain_cli.config import load_config
from bmtrain_cli.ops.quant_tiles import TILE_ELEMENTS
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.estimator import Layout, Workload, estimate_layout

TEXT = """model_config:
  hidden_size: 64
  intermediate_size: 96
  num_hidden_layers: 3
  num_attention_heads: 4
  num_key_value_heads: 2
  vocab_size: 512
{quant}train_config:
  demo_data: arithmetic
  finetuning: lora
  lora_target_modules: {targets}
"""


def _estimate(write_yaml, quant: str, targets: str = "all-linear"):
    config = load_config(write_yaml(TEXT.format(quant=quant, targets=targets))).config
    w = Workload.from_config(config, read_data=False)
    return config, estimate_layout(w, Layout(micro_batch=1), get_device("cpu"))


def test_plan_counts_the_quantised_base_as_built(write_yaml) -> None:
    from bmtrain_cli.models import build
    from bmtrain_cli.quant.layer import quantized_bytes

    for quant in (
        "  quantization:\n    method: nf4\n    block_size: 32\n",
        "  quantization:\n    method: int8\n",
        "  quantization:\n    method: int4\n    skip_modules: [embed_tokens, lm_head, down_proj]\n",
    ):
        _, plain = _estimate(write_yaml, "")
        config, quantised = _estimate(write_yaml, quant)
        model = build(config.model, kernels="reference", quantization=config.model.quantization)
        held = quantized_bytes(model)
        fp32 = sum(int(p.numel()) for n, p in build(config.model).named_parameters() if "layers." in n) * 4
        fp32 -= sum(int(p.numel()) * 4 for n, p in model.named_parameters() if "layers." in n)
        workspace = min(max(i * o for i, o in _projections(model)), TILE_ELEMENTS) * 4  # one CPU tile
        assert held > 0 and plain.parameters - quantised.parameters == fp32 - held - workspace
        assert any(
            "codes and scales" in note and "dequantisation workspace" in note for note in quantised.notes
        )


def test_plan_counts_the_int8_embedding_and_head_as_built(write_yaml) -> None:
    """int8 with embed_tokens and lm_head out of skip_modules: the plan's parameters drop by the fp32
    embedding and head less their built codes and scales, plus the head rows the loss dequantises."""
    from bmtrain_cli.models import build
    from bmtrain_cli.quant.layer import quantized_bytes

    for tied in ("false", "true"):
        text = "  tie_word_embeddings: " + tied + "\n  quantization:\n    method: int8\n"
        config, linear = _estimate(write_yaml, text)
        vocab_config, vocab = _estimate(write_yaml, text + "    skip_modules: [norm, gate]\n")
        model = build(config.model, kernels="reference", quantization=config.model.quantization)
        held = build(config.model, kernels="reference", quantization=vocab_config.model.quantization)
        held_bytes = quantized_bytes(held) - quantized_bytes(model)
        fp32 = sum(int(p.numel()) * 4 for n, p in model.named_parameters() if "embed" in n or "lm_head" in n)
        assert held_bytes == (512 * 64 + 512 * 4) * (1 if tied == "true" else 2)
        assert linear.parameters - vocab.parameters == fp32 - held_bytes - 512 * 64 * 4  # one fp32 head
        assert any("embedding/LM head in int8" in note for note in vocab.notes)


def _projections(model):
    from bmtrain_cli.quant.layer import quantized_layers

    return [(m.in_features, m.out_features) for _, m in quantized_layers(model)]


MOE = """  family: qwen3_moe
  num_experts: 4
  num_experts_per_tok: 2
  moe_intermediate_size: 32
"""
ATTENTION = "[q_proj, k_proj, v_proj, o_proj]"  # LoRA does not reach the experts


def test_plan_counts_a_mixture_of_experts_and_its_quantised_experts_as_built(write_yaml) -> None:
    """qwen3_moe: the plan's parameters count the experts as the built model holds them, and with nf4 the
    experts' codes and scales as built (the router stays fp32)."""
    from bmtrain_cli.models import build
    from bmtrain_cli.models.param_count import count_parameters
    from bmtrain_cli.quant.layer import quantized_bytes, quantized_layers

    config, plain = _estimate(write_yaml, MOE, ATTENTION)
    _, dense = _estimate(write_yaml, "", ATTENTION)
    model = build(config.model)
    built = sum(int(p.numel()) for p in model.parameters())
    assert built == count_parameters(model.arch)
    dense_built = sum(
        int(p.numel())
        for p in build(
            load_config(write_yaml(TEXT.format(quant="", targets=ATTENTION))).config.model
        ).parameters()
    )
    assert plain.parameters - dense.parameters == (built - dense_built) * 4
    quant = MOE + "  quantization:\n    method: nf4\n    block_size: 32\n"
    config, quantised = _estimate(write_yaml, quant, ATTENTION)
    qmodel = build(config.model, kernels="reference", quantization=config.model.quantization)
    names = [n for n, _ in quantized_layers(qmodel)]
    assert sum(".experts." in n for n in names) == 3 * 4 * 3 and len(names) == 3 * (4 * 3 + 4)
    fp32 = sum(int(p.numel()) for n, p in model.named_parameters() if "layers." in n) * 4
    fp32 -= sum(int(p.numel()) * 4 for n, p in qmodel.named_parameters() if "layers." in n)
    workspace = min(max(i * o for i, o in _projections(qmodel)), TILE_ELEMENTS) * 4
    assert plain.parameters - quantised.parameters == fp32 - quantized_bytes(qmodel) - workspace


def test_plan_counts_each_expert_parallel_ranks_share_of_the_quantised_experts(write_yaml) -> None:
    """Under expert_parallel 2 a rank holds the codes and scales of 2 of the 4 experts of every sparse
    layer (and, with LoRA on the experts, their adapters alone): the plan's parameters drop by the other
    experts' codes and scales as built, and by their adapters."""
    from bmtrain_cli.lora.inject import apply_lora
    from bmtrain_cli.models import build
    from bmtrain_cli.quant.layer import quantized_layers

    quant = MOE + "  quantization:\n    method: nf4\n    block_size: 32\n"
    for targets in (ATTENTION, "all-linear"):
        config, whole = _estimate(write_yaml, quant, targets)
        w = Workload.from_config(config, read_data=False)
        half = estimate_layout(w, Layout(micro_batch=1, ep=2), get_device("cpu"))
        model = build(config.model, kernels="reference", quantization=config.model.quantization)
        apply_lora(model, config.train)
        others = (".experts.2.", ".experts.3.")  # rank 0 holds experts 0 and 1
        codes = sum(m.nbytes for n, m in quantized_layers(model) if any(o in n + "." for o in others))
        adapters = sum(
            int(p.numel())
            for n, p in model.named_parameters()
            if "lora_" in n and any(o in n for o in others)
        )
        assert codes > 0 and (adapters > 0) == (targets == "all-linear")
        assert whole.parameters - half.parameters == codes + adapters * 4


QWEN25_7B = """model_config:
  model_name_or_path: Qwen/Qwen2.5-7B-Instruct
  dtype: bfloat16
  max_seq_len: 4096
{quant}train_config:
  data_path: {data}
  finetuning: lora
  precision: bf16
  gradient_checkpointing: true
  micro_batch_size: 1
"""
# Qwen3-30B-A3B's shape: 48 layers of 128 experts (8 active), 30.5B parameters
QWEN3_30B_A3B = """model_config:
  family: qwen3_moe
  hidden_size: 2048
  intermediate_size: 6144
  num_hidden_layers: 48
  num_attention_heads: 32
  num_key_value_heads: 4
  head_dim: 128
  vocab_size: 151936
  num_experts: 128
  num_experts_per_tok: 8
  moe_intermediate_size: 768
  tie_word_embeddings: false
  max_position_embeddings: 4096
  max_seq_len: 4096
  dtype: bfloat16
{quant}train_config:
  data_path: {data}
  finetuning: lora
  lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
  precision: bf16
  gradient_checkpointing: true
  micro_batch_size: 1
"""
GIB = 1 << 30
NF4 = "  quantization:\n    method: nf4\n"


def _plan(write_yaml, tmp_path, text: str, quant: str, device: str) -> dict:
    import json

    from typer.testing import CliRunner

    from bmtrain_cli.cli import app

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "hello"}\n')
    path = write_yaml(text.format(quant=quant, data=data))
    res = CliRunner().invoke(app, ["plan", "-c", str(path), "--device", device, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout[res.stdout.index("{") :])["estimate"]


def test_plan_says_what_fits_for_qlora_7b_on_24gib_and_a_30b_moe_on_80gib(write_yaml, tmp_path) -> None:
    """A 7B QLoRA (nf4, bf16 compute, 4096 tokens, full recompute) fits one 24 GiB GPU with its base near
    a quarter of bf16's; a 30B mixture of experts QLoRA fits one 80 GiB GPU (and even a 24 GiB one) with
    its experts quantised, where bf16 LoRA needs more than 48 GiB."""
    seven = _plan(write_yaml, tmp_path, QWEN25_7B, NF4, "RTX4090")
    seven_bf16 = _plan(write_yaml, tmp_path, QWEN25_7B, "", "RTX4090")
    assert seven["fits"] and seven["required"] < 12 * GIB, seven
    assert seven["parameters"] < 0.4 * seven_bf16["parameters"]
    moe = _plan(write_yaml, tmp_path, QWEN3_30B_A3B, NF4, "A100-80GB")
    moe_bf16 = _plan(write_yaml, tmp_path, QWEN3_30B_A3B, "", "A100-80GB")
    assert moe["fits"] and moe["required"] < 24 * GIB, moe
    # the experts are most of the 30.5B parameters: quantised, the base is about 0.3x of bf16
    assert moe["parameters"] < 0.3 * moe_bf16["parameters"] and moe_bf16["required"] > 48 * GIB
    assert _plan(write_yaml, tmp_path, QWEN3_30B_A3B, NF4, "RTX4090")["fits"]
    assert not _plan(write_yaml, tmp_path, QWEN3_30B_A3B, "", "A100-40GB")["fits"]
