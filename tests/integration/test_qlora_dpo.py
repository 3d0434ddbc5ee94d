"""DPO with LoRA on a quantised base (QLoRA, model_config.quantization nf4 and int8): the preference
recipe runs on the quantised policy (the reference is the same base with the adapters off), the loss
moves, the reward margin grows, and only the adapters are saved (tests/integration/lora_dpo.py)."""

from __future__ import annotations

import json

import pytest

from tests.integration.lora_dpo import run_dpo, sft_base_and_pairs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sft_base(tmp_path_factory):
    return sft_base_and_pairs(tmp_path_factory.mktemp("qlora-dpo"))


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_dpo_trains_on_a_quantised_base(method, tmp_path, sft_base):
    base, data = sft_base
    model = f"  kernels: reference\n  quantization:\n    method: {method}\n"
    res, ckpt, _ = run_dpo(tmp_path, base, data, model, "all-linear")
    assert f"linear layers in {method}" in res.output, res.output
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    record = json.loads((ckpt / "lora_base.json").read_text())
    assert record["quantization"]["method"] == method
