"""The model_config keys of DeepSeek-V3's latent attention and the sigmoid group-limited router (glm4_moe,
deepseek_v3): a fresh model takes them (built with those sizes, a training step runs, config.json carries
them so transformers' reader gets the same model), and validate-config refuses them, at file:line, for a
family without them or with sizes the family cannot build."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.load import load_config
from bmtrain_cli.config.schema import ModelConfig
from bmtrain_cli.errors import ConfigError
from bmtrain_cli.models.arch import arch_from_hf_dict, arch_from_model_config, arch_to_hf_dict
from bmtrain_cli.models.hf import build
from bmtrain_cli.models.param_count import count_parameters

QUICKSTART = str(Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml")
MLA = dict(q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=6, v_head_dim=10)
ROUTER = dict(n_shared_experts=2, first_k_dense_replace=1, n_group=3, topk_group=2, routed_scaling_factor=1.5)


def test_a_fresh_deepseek_v3_with_the_given_sizes():
    cfg = ModelConfig(
        family="deepseek_v3",
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=96,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=False,
        **MLA,
        **ROUTER,
    )
    arch = arch_from_model_config(cfg)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_nope_head_dim, arch.head_dim, arch.v_head_dim) == (
        24,
        20,
        12,
        6,
        10,
    )
    assert (arch.moe_shared_experts, arch.moe_layer_start, arch.moe_groups, arch.moe_topk_groups) == (
        2,
        1,
        3,
        2,
    )
    assert arch.routed_scaling_factor == 1.5 and not arch.norm_topk_prob
    hf = arch_to_hf_dict(arch)
    assert {k: hf[k] for k in MLA} == MLA and {k: hf[k] for k in ROUTER} == ROUTER
    assert arch_from_hf_dict(hf) == arch  # what config.json says is this model
    paddle.seed(0)
    model = build(arch)
    assert count_parameters(arch) == sum(int(np.prod(p.shape)) for p in model.parameters())
    attn = model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape == [24, 4 * (12 + 6)] and attn.kv_b_proj.weight.shape == [20, 4 * 22]
    assert attn.o_proj.weight.shape == [4 * 10, 48]
    assert not model.layers[0].sparse and model.layers[1].sparse
    assert model.layers[1].mlp.shared_experts.gate_proj.weight.shape == [48, 2 * 16]
    ids = paddle.randint(0, 96, [2, 10])
    total, count = model.loss_sum(ids, ids)
    (total / count).backward()
    assert np.isfinite(float(total)) and model.layers[0].self_attn.kv_b_proj.weight.grad is not None


def test_a_fresh_glm4_moe_takes_the_router_settings():
    arch = arch_from_model_config(ModelConfig(family="glm4_moe", num_experts=6, **ROUTER))
    assert (arch.moe_groups, arch.moe_topk_groups, arch.moe_layer_start, arch.moe_shared_experts) == (
        3,
        2,
        1,
        2,
    )
    assert arch.routed_scaling_factor == 1.5 and arch.kv_lora_rank == 0


def _problems(*sets):
    with pytest.raises(ConfigError) as exc:
        load_config(QUICKSTART, list(sets), mode="validate")
    return exc.value.problems


@pytest.mark.parametrize(
    "family, key, value, says",
    [
        ("llama", "kv_lora_rank", 16, "llama has no kv_lora_rank"),
        ("glm4_moe", "qk_rope_head_dim", 8, "glm4_moe has no qk_rope_head_dim"),
        ("qwen3_moe", "n_group", 2, "qwen3_moe has no n_group"),
        ("mixtral", "norm_topk_prob", "false", "mixtral has no norm_topk_prob"),
        ("glm4_moe", "n_group", 3, "equal groups"),  # 8 experts in 3 groups
        ("deepseek_v3", "topk_group", 1, "topk_group"),  # 1 of 4 groups of 2 experts: not the top 3
    ],
)
def test_validate_config_refuses_what_the_family_cannot_take(family, key, value, says):
    sets = [f"model_config.family={family}", f"model_config.{key}={value}"]
    if family in ("glm4_moe", "deepseek_v3"):
        sets += ["model_config.num_experts=8", "model_config.num_experts_per_tok=3"]
        if key == "topk_group":
            sets.append("model_config.n_group=4")
    problems = _problems(*sets)
    hit = [p for p in problems if says in p.message]
    placed = [s.split("=")[0] for s in sets[1:]]  # at one of the keys set
    assert hit and hit[0].path in placed, [p.format() for p in problems]


def test_validate_config_places_the_key_in_the_file(tmp_path):
    text = Path(QUICKSTART).read_text().replace("  family: llama\n", "  family: llama\n  q_lora_rank: 8\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(str(cfg), [], mode="validate")
    (hit,) = [p for p in exc.value.problems if p.path == "model_config.q_lora_rank"]
    assert f"{cfg}:9" in hit.format()
