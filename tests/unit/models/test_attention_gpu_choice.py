"""The attention kernel a GPU gets, decided from simulated facts (compute capability, head_dim,
FLAGS_flash_attn_version, training) since the CPU build cannot run Paddle's flash kernels."""

from __future__ import annotations

import pytest

from bmtrain_cli.models.attention import flash_version
from bmtrain_cli.models.attention_choice import choose_kernel, flash_refusal

A100, H100, V100, T4 = (8, 0), (9, 0), (7, 0), (7, 5)


@pytest.mark.parametrize("cap", [A100, H100, (12, 0)])
def test_flash_on_ampere_and_newer(cap):
    assert choose_kernel("causal", "auto", True, True, capability=cap, head_dim=128)[0] == "flash"
    assert choose_kernel("segments", "auto", True, True, capability=cap, head_dim=128)[0] == "flash_varlen"


@pytest.mark.parametrize("cap", [V100, T4])
def test_no_flash_below_compute_capability_8(cap):
    kernel, why = choose_kernel("causal", "auto", True, True, capability=cap, head_dim=64)
    assert kernel == "sdpa_causal" and "< 8.0" in why
    assert choose_kernel("segments", "auto", True, True, capability=cap, head_dim=64)[0] == "sdpa_mask"


def test_head_dim_above_256_is_kept_from_flash():
    kernel, why = choose_kernel("causal", "auto", True, True, capability=H100, head_dim=512)
    assert kernel == "sdpa_causal" and "drop causal" in why
    assert choose_kernel("causal", "auto", True, True, capability=H100, head_dim=256)[0] == "flash"


def test_fa3_without_training_goes_to_sdpa_and_varlen_stays():
    kernel, why = choose_kernel(
        "causal", "auto", True, True, capability=H100, head_dim=128, fa_version=3, training=False
    )
    assert kernel == "sdpa_causal" and "training=False" in why
    assert (
        choose_kernel("causal", "auto", True, True, capability=H100, fa_version=3, training=True)[0]
        == "flash"
    )
    # flash_attn_unpadded always runs FA2: evaluation of packed rows keeps it
    assert (
        choose_kernel("segments", "auto", True, True, capability=H100, fa_version=3, training=False)[0]
        == "flash_varlen"
    )


def test_gpu_fp32_takes_sdpa_not_the_python_blocked_kernel():
    for cap in (A100, V100):
        assert choose_kernel("causal", "auto", False, True, capability=cap, seq_len=8192)[0] == "sdpa_causal"
        assert choose_kernel("segments", "auto", False, True, capability=cap, seq_len=8192)[0] == "sdpa_mask"


def test_flash_refusal_unknown_facts_are_fit_and_flag_reading():
    assert flash_refusal(None, None) is None
    assert flash_version({"FLAGS_flash_attn_version": 3, "FLAGS_cudnn_deterministic": False}) == 3
    assert flash_version({"FLAGS_flash_attn_version": 3, "FLAGS_cudnn_deterministic": True}) == 2
    assert flash_version({}) == 2
