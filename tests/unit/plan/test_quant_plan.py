"""`bmtrain plan` with model_config.quantization counts the quantised base (codes and scales) in place of
its full-precision projections: the count equals what a built quantised model holds."""

from __future__ import annotations

from bmtrain_cli.config import load_config
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
  lora_target_modules: all-linear
"""


def _estimate(write_yaml, quant: str):
    config = load_config(write_yaml(TEXT.format(quant=quant))).config
    w = Workload.from_config(config, read_data=False)
    return config, estimate_layout(w, Layout(micro_batch=1), get_device("cpu"))


def test_plan_counts_the_quantised_base_as_built(write_yaml) -> None:
    from bmtrain_cli.models import build
    from bmtrain_cli.quant.layer import quantized_bytes

    for quant in (
        "  quantization:\n    method: nf4\n    block_size: 32\n",
        "  quantization:\n    method: int8\n",
        "  quantization:\n    method: int4\n    skip_modules: [lm_head, down_proj]\n",
    ):
        _, plain = _estimate(write_yaml, "")
        config, quantised = _estimate(write_yaml, quant)
        model = build(config.model, kernels="reference", quantization=config.model.quantization)
        held = quantized_bytes(model)
        fp32 = sum(int(p.numel()) for n, p in build(config.model).named_parameters() if "layers." in n) * 4
        fp32 -= sum(int(p.numel()) * 4 for n, p in model.named_parameters() if "layers." in n)
        assert held > 0 and plain.parameters - quantised.parameters == fp32 - held
        assert any("codes and scales" in note for note in quantised.notes)
