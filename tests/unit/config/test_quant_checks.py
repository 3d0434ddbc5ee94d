"""validate-config for model_config.quantization (QLoRA): what this version cannot run on a quantised
base is refused at the key's file:line, with the reason; a plain QLoRA config passes."""

from __future__ import annotations

import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.errors import ConfigError
from bmtrain_cli.quant.select import is_skipped

MODEL = "model_config:\n  hidden_size: 64\n  num_attention_heads: 4\n  quantization:\n    method: {method}\n{quant}"
TRAIN = "train_config:\n  finetuning: {finetuning}\n  demo_data: arithmetic\n{train}"


def _text(method="nf4", quant="", finetuning="lora", train="", parallel="") -> str:
    return (
        MODEL.format(method=method, quant=quant) + TRAIN.format(finetuning=finetuning, train=train) + parallel
    )


def test_a_qlora_config_passes(write_yaml):
    cfg = load_config(write_yaml(_text(quant="    double_quant: false\n    block_size: 128\n")))
    q = cfg.config.model.quantization
    assert (q.method, q.resolved_block_size, q.skip_modules) == (
        "nf4",
        128,
        ["embed_tokens", "lm_head", "norm", "gate"],
    )
    assert load_config(write_yaml(_text(method="int8"))).config.model.quantization.resolved_block_size == 0
    for method in ("int8", "nf4"):  # the embedding and head in int8 beside int8 or nf4 layers
        vocab = load_config(write_yaml(_text(method=method, quant="    skip_modules: [norm, gate]\n")))
        assert vocab.config.model.quantization.skip_modules == ["norm", "gate"]


@pytest.mark.parametrize(
    "kwargs, line, message",
    [
        ({"finetuning": "full"}, 7, "only LoRA trains on it"),
        ({"parallel": "parallel:\n  tensor_parallel: 2\n"}, 4, "its own shard of o_proj"),
        ({"parallel": "parallel:\n  tensor_parallel: 2\n", "method": "int4"}, 4, "int4 groups of 64"),
        ({"train": "  to_static: true\n"}, 9, "dygraph only"),
        ({"method": "int8", "quant": "    block_size: 32\n"}, 6, "no block size"),
        ({"method": "int4", "quant": "    double_quant: true\n"}, 6, "int4 has none"),
        ({"quant": "    double_quant: true\n"}, 6, "would not be exact"),
        ({"quant": "    compute_dtype: bfloat16\n"}, 6, "not supported yet"),
        (
            {"quant": "    skip_modules: [embed_tokens]\n", "parallel": "parallel:\n  tensor_parallel: 2\n"},
            6,
            "lm_head cannot be quantised here: they are quantised whole",
        ),
        (
            {
                "method": "int8",
                "quant": "    skip_modules: [norm]\n",
                "parallel": "parallel:\n  pipeline_parallel: 2\n",
            },
            6,
            "no tensor or pipeline parallel split",
        ),
        ({"method": "nf3"}, 5, "'nf4', 'int8' or 'int4'"),
    ],
)
def test_refused_at_file_line(write_yaml, kwargs, line, message):
    path = write_yaml(_text(**kwargs))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert message in text, text
    assert any(f"{path}:{line}:" in row and message in row for row in text.splitlines()), text


def test_skip_modules_match_whole_name_components():
    skip = ["lm_head", "gate", "layers.1"]
    assert is_skipped("lm_head", skip) and is_skipped("model.layers.1.mlp.up_proj", skip)
    assert is_skipped("model.layers.0.mlp.gate", skip)  # a MoE router
    assert not is_skipped("model.layers.0.mlp.gate_proj", skip)
    assert not is_skipped("model.layers.11.mlp.up_proj", skip)


@pytest.mark.parametrize("method, quant", [("nf4", "    block_size: 32\n"), ("int4", ""), ("int8", "")])
def test_tensor_parallel_passes_when_blocks_do_not_straddle_shards(write_yaml, method, quant):
    """hidden 64, 4 heads of 16, intermediate 128 under tp2: o_proj's row shards hold 32 inputs, so nf4
    blocks of 32 fit (64 do not, above); int8's scale spans the whole row; int4 needs groups of 32 too."""
    text = _text(method=method, quant=quant, parallel="parallel:\n  tensor_parallel: 2\n")
    text = text.replace("  hidden_size: 64\n", "  hidden_size: 64\n  intermediate_size: 128\n")
    if method == "int4":
        with pytest.raises(ConfigError, match="int4 groups of 64"):
            load_config(write_yaml(text))
        text = text.replace("    method: int4\n", "    method: int4\n    block_size: 32\n")
    cfg = load_config(write_yaml(text)).config
    assert cfg.parallel.tensor_parallel == 2 and cfg.model.quantization.method == method


def test_a_mixture_of_experts_qlora_config_passes(write_yaml):
    """The experts are quantised with the rest (the router, ``gate``, stays full precision); LoRA stays on
    the attention projections as for any MoE model."""
    text = _text(train="  lora_target_modules: [q_proj, v_proj]\n").replace(
        "  hidden_size: 64\n",
        "  hidden_size: 64\n  family: qwen3_moe\n  num_experts: 4\n  moe_intermediate_size: 32\n",
    )
    cfg = load_config(write_yaml(text)).config
    assert cfg.model.num_experts == 4 and cfg.model.quantization.method == "nf4"
