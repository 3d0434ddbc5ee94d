"""DPO on a mixture-of-experts policy through `bmtrain train`: a tiny qwen3_moe trained by SFT, then DPO
with LoRA on the attention and on every expert's gate/up/down (the grouped GEMM on a CPU with our
kernels). The policy starts equal to the reference (loss log 2), the loss falls, the margin grows, and
only the adapters are saved, the experts' among them (tests/integration/lora_dpo.py)."""

from __future__ import annotations

import pytest
from safetensors.numpy import load_file

from bmtrain_cli.lora.merge import load_adapter_arrays
from tests.integration.lora_dpo import run_dpo, sft_base_and_pairs

pytestmark = pytest.mark.slow


def test_dpo_with_lora_on_the_experts_of_a_qwen3_moe(tmp_path):
    base, data = sft_base_and_pairs(tmp_path, "model_config.family=qwen3_moe", "model_config.num_experts=4")
    _, ckpt, _ = run_dpo(tmp_path, base, data, "", "[q_proj, v_proj, gate_proj, up_proj, down_proj]")
    stacked = [n for n in load_file(str(ckpt / "adapter_model.safetensors")) if ".mlp.experts." in n]
    # as PEFT adapts transformers' stacked experts: 2 layers x (gate_up_proj, down_proj) x A/B
    assert len(stacked) == 2 * 2 * 2, stacked
    names = list(load_adapter_arrays(ckpt))  # read back per expert
    experts = [n for n in names if ".mlp.experts." in n]
    # the tiny model's 2 layers x 4 experts x gate/up/down x A/B
    assert len(experts) == 2 * 4 * 3 * 2, names
