"""DPO on a mixture-of-experts policy through `bmtrain train`: a tiny qwen3_moe trained by SFT, then DPO
with LoRA on the attention and on every expert's gate/up/down (the grouped GEMM on a CPU with our
kernels). The policy starts equal to the reference (loss log 2), the loss falls, the margin grows, and
only the adapters are saved, the experts' among them (tests/integration/lora_dpo.py). The load-balancing
loss is on (output_router_logits): each step's loss holds coef x aux and metrics.jsonl logs aux_loss."""

from __future__ import annotations

import math

import pytest
from safetensors.numpy import load_file

from bmtrain_cli.lora.merge import load_adapter_arrays
from tests.integration.lora_dpo import run_dpo, sft_base_and_pairs

pytestmark = pytest.mark.slow


def test_dpo_with_lora_on_the_experts_of_a_qwen3_moe(tmp_path):
    base, data = sft_base_and_pairs(tmp_path, "model_config.family=qwen3_moe", "model_config.num_experts=4")
    # a small coefficient keeps step 1 within run_dpo's log 2 check; the exact sum is checked below
    aux_on = "  output_router_logits: true\n  router_aux_loss_coef: 1.0e-4\n"
    _, ckpt, steps = run_dpo(tmp_path, base, data, aux_on, "[q_proj, v_proj, gate_proj, up_proj, down_proj]")
    aux = [r["aux_loss"] for r in steps]
    assert all(math.isfinite(a) and a > 0 for a in aux), steps
    # step 1: the policy is the reference, so the pair loss is log 2 and the rest is coef x aux
    assert steps[0]["loss"] - 1.0e-4 * aux[0] == pytest.approx(math.log(2), abs=1e-5)
    stacked = [n for n in load_file(str(ckpt / "adapter_model.safetensors")) if ".mlp.experts." in n]
    # as PEFT adapts transformers' stacked experts: 2 layers x (gate_up_proj, down_proj) x A/B
    assert len(stacked) == 2 * 2 * 2, stacked
    names = list(load_adapter_arrays(ckpt))  # read back per expert
    experts = [n for n in names if ".mlp.experts." in n]
    # the tiny model's 2 layers x 4 experts x gate/up/down x A/B
    assert len(experts) == 2 * 4 * 3 * 2, names
