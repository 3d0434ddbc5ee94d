"""`bmtrain export --format gguf` without llama.cpp or transformers: the tensor layout (names from gguf's
map, q/k interleaving, tied heads, Baichuan's W_pack and norm_head), the metadata read back with
gguf.GGUFReader, the dequantised weights against the model's, the Modelfile, and the refusals."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from bmtrain_cli.errors import UserError
from tests.unit.export.gguf_models import CHATML, family_checkpoint, field_value

gguf = pytest.importorskip("gguf")


def _tiny(family, **kw):
    import paddle

    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.models.families import family as family_of

    paddle.seed(0)
    arch = ModelArch(
        family=family,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        **family_of(family).defaults,
    )
    return build(replace(arch, **kw), kernels="reference")


def _unpermute(w, n_head):
    """transformers' reading of llama.cpp's interleaved q/k rows (an independent inverse)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_llama_names_and_qk_interleaving():
    from bmtrain_cli.export.gguf_export import gguf_tensors
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("llama")
    t, hf = gguf_tensors(model), hf_state_dict(model)
    per_block = [
        "attn_norm",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_norm",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    expected |= {f"blk.{b}.{n}.weight" for b in range(2) for n in per_block}
    assert set(t) == expected
    q, k = hf["model.layers.1.self_attn.q_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"]
    assert not np.array_equal(t["blk.1.attn_q.weight"], q)
    np.testing.assert_array_equal(_unpermute(t["blk.1.attn_q.weight"], 4), q)
    np.testing.assert_array_equal(_unpermute(t["blk.1.attn_k.weight"], 2), k)
    np.testing.assert_array_equal(t["blk.0.ffn_down.weight"], hf["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_array_equal(t["output.weight"], hf["lm_head.weight"])


def test_qwen_layouts_are_not_permuted_and_keep_biases_and_qk_norms():
    from bmtrain_cli.export.gguf_export import gguf_tensors
    from bmtrain_cli.models import hf_state_dict

    q2 = _tiny("qwen2")
    t, hf = gguf_tensors(q2), hf_state_dict(q2)
    np.testing.assert_array_equal(t["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(t["blk.0.attn_k.bias"], hf["model.layers.0.self_attn.k_proj.bias"])
    assert "blk.0.attn_output.bias" not in t
    t3 = gguf_tensors(_tiny("qwen3", tie_word_embeddings=True))
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= set(t3)
    assert "output.weight" not in t3 and "token_embd.weight" in t3


def test_baichuan_w_pack_split_and_norm_head():
    from bmtrain_cli.export.gguf_export import gguf_tensors
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("baichuan", norm_head=True, num_hidden_layers=32)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    w_pack = hf["model.layers.0.self_attn.W_pack.weight"]
    np.testing.assert_array_equal(_unpermute(t["blk.0.attn_q.weight"], 4), w_pack[:32])
    np.testing.assert_array_equal(_unpermute(t["blk.0.attn_k.weight"], 2), w_pack[32:48])
    np.testing.assert_array_equal(t["blk.0.attn_v.weight"], w_pack[48:])
    np.testing.assert_allclose(np.linalg.norm(t["output.weight"], axis=1), 1.0, rtol=1e-5)


def test_llama3_rope_scaling_becomes_rope_freqs():
    from bmtrain_cli.export.gguf_export import gguf_tensors

    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    f = gguf_tensors(_tiny("llama", rope_scaling=scaling, head_dim=16, num_attention_heads=2))[
        "rope_freqs.weight"
    ]
    # llama.cpp's converter: per frequency, 1 (short wavelengths), factor (long) or the smoothed ratio
    expected = []
    for freq in 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16):
        wavelen = 2 * np.pi / freq
        smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
        expected.append(1.0 if wavelen < 16 else 8.0 if wavelen > 64 else 1 / ((1 - smooth) / 8.0 + smooth))
    np.testing.assert_allclose(f, expected, rtol=1e-5)
    assert f[0] == 1.0 and f[-1] == 8.0


def test_phi3_keeps_fused_projections_partial_rotary_and_longrope(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    half = 3  # rotary dim 6 of head_dim 8 (partial_rotary_factor 0.75, as Phi-4-mini)
    scaling = {
        "rope_type": "longrope",
        "long_factor": [1.0, 2.0, 4.0],
        "short_factor": [1.0, 1.5, 2.0],
        "original_max_position_embeddings": 32,
    }
    model = _tiny(
        "phi3", partial_rotary_factor=0.75, rope_scaling=scaling, max_position_embeddings=128, vocab_size=512
    )
    t, hf = gguf_tensors(model), hf_state_dict(model)
    np.testing.assert_array_equal(t["blk.0.attn_qkv.weight"], hf["model.layers.0.self_attn.qkv_proj.weight"])
    np.testing.assert_array_equal(t["blk.1.ffn_up.weight"], hf["model.layers.1.mlp.gate_up_proj.weight"])
    assert "blk.0.attn_q.weight" not in t and "blk.0.ffn_gate.weight" not in t
    np.testing.assert_array_equal(t["rope_factors_long.weight"], [1.0, 2.0, 4.0])
    np.testing.assert_array_equal(t["rope_factors_short.weight"], [1.0, 1.5, 2.0])
    assert t["rope_factors_long.weight"].shape == (half,)
    summary = write_gguf(model, sp_tokenizer, tmp_path / "g")
    assert summary.tensor_types["rope_factors_long.weight"] == "f32"
    r = gguf.GGUFReader(str(summary.path))
    assert field_value(r, "phi3.rope.dimension_count") == 2 * half
    assert field_value(r, "phi3.rope.scaling.original_context_length") == 32
    # LongRoPE's attention factor for 128 / 32 positions: sqrt(1 + ln 4 / ln 32)
    assert field_value(r, "phi3.rope.scaling.attn_factor") == pytest.approx(
        (1 + np.log(4) / np.log(32)) ** 0.5
    )


def test_gemma3_norms_hold_one_plus_weight_and_the_window_is_recorded(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("gemma3_text", sliding_window=4, query_pre_attn_scalar=8, vocab_size=512)
    for p in model.parameters():  # Gemma's norms start at 0: move them so that +1 is not all ones
        if p.ndim == 1:
            p.set_value(p + 0.25)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    for ours, theirs in [
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("blk.1.post_ffw_norm.weight", "model.layers.1.post_feedforward_layernorm.weight"),
        ("blk.0.attn_q_norm.weight", "model.layers.0.self_attn.q_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        np.testing.assert_array_equal(t[ours], hf[theirs] + 1.0)
    np.testing.assert_array_equal(t["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    assert "output.weight" not in t  # tied, as Gemma's
    r = gguf.GGUFReader(str(write_gguf(model, sp_tokenizer, tmp_path / "g").path))
    assert field_value(r, "general.architecture") == "gemma3"
    assert field_value(r, "gemma3.attention.sliding_window") == 4
    assert field_value(r, "gemma3.attention.key_length") == 8


def test_qwen3_moe_experts_are_stacked_per_layer(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=512)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    assert t["blk.1.ffn_gate_exps.weight"].shape == (4, 16, 32)
    assert t["blk.1.ffn_down_exps.weight"].shape == (4, 32, 16)
    for e in range(4):
        for proj, name in [
            ("gate_proj", "ffn_gate_exps"),
            ("up_proj", "ffn_up_exps"),
            ("down_proj", "ffn_down_exps"),
        ]:
            np.testing.assert_array_equal(
                t[f"blk.1.{name}.weight"][e], hf[f"model.layers.1.mlp.experts.{e}.{proj}.weight"]
            )
    np.testing.assert_array_equal(t["blk.0.ffn_gate_inp.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert not any(".experts." in n for n in t)
    r = gguf.GGUFReader(str(write_gguf(model, sp_tokenizer, tmp_path / "g").path))
    assert field_value(r, "general.architecture") == "qwen3moe"
    assert field_value(r, "qwen3moe.expert_count") == 4
    assert field_value(r, "qwen3moe.expert_used_count") == 2
    assert field_value(r, "qwen3moe.expert_feed_forward_length") == 16


# read as rope_freqs by llama.cpp's llama architecture only
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}


@pytest.mark.parametrize(
    "family, kw, needle",
    [
        ("gemma3_text", dict(layer_types=("full_attention", "sliding_attention")), "every 6th layer global"),
        ("gemma3_text", dict(rope_local_theta=5000.0), "rope base 10000"),
        ("gemma3_text", dict(query_pre_attn_scalar=64.0), "query_pre_attn_scalar"),
        ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, mlp_only_layers=(0,)), "every layer"),
        ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, norm_topk_prob=False), "norm_topk_prob"),
        # layer 2 dense by the interval of 2: llama.cpp's loader wants experts there
        (
            "ernie4_5_moe",
            dict(num_experts=4, moe_intermediate_size=16, num_hidden_layers=3, decoder_sparse_step=2),
            "every layer after the 1 leading dense",
        ),
        ("glm4_moe", dict(mlp_only_layers=(1,)), "every layer after the 1 leading dense"),
        ("glm4_moe", dict(moe_shared_experts=0), "always adds a shared expert"),
        ("glm4_moe", dict(routed_scaling_factor=0.0), "expert_weights_scale 0"),
        ("qwen2", dict(rope_scaling=LLAMA3_SCALING), "'llama3' is not exported for qwen2"),
        ("glm4_moe", dict(rope_scaling=LLAMA3_SCALING), "'llama3' is not exported for glm4_moe"),
        ("baichuan", dict(num_hidden_layers=30), "only to 32-layer"),
        (
            "llama",
            dict(
                rope_scaling={
                    "rope_type": "longrope",
                    "long_factor": [1.0] * 4,
                    "short_factor": [1.0] * 4,
                    "original_max_position_embeddings": 8,
                }
            ),
            "longrope",
        ),
    ],
)
def test_what_llama_cpp_fixes_is_refused_when_the_model_differs(family, kw, needle):
    from bmtrain_cli.export.gguf_arch import check_exportable

    with pytest.raises(UserError, match=needle):
        check_exportable(replace(_tiny(family).arch, **kw))


def test_a_family_without_a_llama_cpp_architecture_is_refused_by_name(monkeypatch):
    from bmtrain_cli.export import gguf_arch

    monkeypatch.delitem(gguf_arch.GGUF_ARCHS, "glm4")
    with pytest.raises(UserError, match="the glm4 family is not written to GGUF"):
        gguf_arch.check_exportable(_tiny("glm4").arch)


def test_the_qwen3_5_linear_attention_is_refused_with_the_reason():
    from pathlib import Path

    from bmtrain_cli.export.gguf_arch import check_exportable
    from bmtrain_cli.models.arch import read_hf_config

    fixture = Path(__file__).resolve().parents[2] / "fixtures" / "hf" / "qwen3_5_text"
    with pytest.raises(UserError, match="linear-attention .Gated DeltaNet. layers are not written to GGUF"):
        check_exportable(read_hf_config(str(fixture)))


def test_mixtral_and_ernie4_5_moe_experts_shared_experts_and_score_bias(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=512)
    mixtral = _tiny("mixtral", **moe)
    t, hf = gguf_tensors(mixtral), hf_state_dict(mixtral)
    for e in range(4):
        np.testing.assert_array_equal(
            t["blk.1.ffn_gate_exps.weight"][e], hf[f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight"]
        )
        np.testing.assert_array_equal(
            t["blk.1.ffn_down_exps.weight"][e], hf[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"]
        )
    assert "blk.0.ffn_gate_inp.weight" in t and not any(".experts." in n for n in t)

    ernie = _tiny("ernie4_5_moe", num_hidden_layers=3, moe_layer_start=1, moe_shared_experts=2, **moe)
    t, hf = gguf_tensors(ernie), hf_state_dict(ernie)
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_exps.weight" not in t  # the leading dense layer
    assert t["blk.1.ffn_up_exps.weight"].shape == (4, 16, 32)
    assert t["blk.1.ffn_gate_shexp.weight"].shape == (32, 32)
    np.testing.assert_array_equal(
        t["blk.2.exp_probs_b.bias"],
        hf["model.layers.2.mlp.moe_statics.e_score_correction_bias"].reshape(-1),
    )
    r = gguf.GGUFReader(str(write_gguf(ernie, sp_tokenizer, tmp_path / "g").path))
    assert field_value(r, "general.architecture") == "ernie4_5-moe"
    assert field_value(r, "ernie4_5-moe.leading_dense_block_count") == 1
    assert field_value(r, "ernie4_5-moe.interleave_moe_layer_step") == 1
    assert field_value(r, "ernie4_5-moe.expert_shared_count") == 2
    assert field_value(r, "ernie4_5-moe.expert_shared_feed_forward_length") == 32


def test_glm4_moe_router_settings_score_bias_shared_experts_and_dense_lead(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    moe = dict(num_hidden_layers=3, moe_intermediate_size=16, vocab_size=512, routed_scaling_factor=2.5)
    model = _tiny("glm4_moe", moe_groups=4, moe_topk_groups=2, qk_norm=True, **moe)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    # half-split partial rope in both: q/k rows as transformers holds them
    np.testing.assert_array_equal(t["blk.1.attn_k.weight"], hf["model.layers.1.self_attn.k_proj.weight"])
    assert {"blk.0.attn_q.bias", "blk.0.attn_v.bias", "blk.0.attn_q_norm.weight"} <= set(t)
    assert "blk.0.attn_output.bias" not in t
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t  # first_k_dense_replace 1
    assert t["blk.2.ffn_down_exps.weight"].shape == (8, 32, 16)
    assert t["blk.2.ffn_up_shexp.weight"].shape == (16, 32)
    np.testing.assert_array_equal(
        t["blk.2.exp_probs_b.bias"], hf["model.layers.2.mlp.gate.e_score_correction_bias"]
    )
    assert t["blk.1.post_attention_norm.weight"].shape == (32,)  # llama.cpp's pre-MLP norm for glm4moe
    r = gguf.GGUFReader(str(write_gguf(model, sp_tokenizer, tmp_path / "g").path))
    meta = {
        k: field_value(r, f"glm4moe.{k}")
        for k in (
            "leading_dense_block_count",
            "expert_shared_count",
            "expert_count",
            "expert_used_count",
            "expert_gating_func",
            "expert_weights_norm",
            "expert_group_count",
            "expert_group_used_count",
            "rope.dimension_count",
        )
    }
    assert meta == {
        "leading_dense_block_count": 1,
        "expert_shared_count": 1,
        "expert_count": 8,
        "expert_used_count": 2,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "expert_weights_norm": True,
        "expert_group_count": 4,
        "expert_group_used_count": 2,
        "rope.dimension_count": 4,  # head_dim 8 x partial_rotary_factor 0.5
    }
    assert field_value(r, "glm4moe.expert_weights_scale") == pytest.approx(2.5)
    # every group kept is no group limit: llama.cpp refuses group keys that say so, none are written
    kept = gguf.GGUFReader(
        str(
            write_gguf(
                _tiny("glm4_moe", moe_groups=4, moe_topk_groups=4, **moe), sp_tokenizer, tmp_path / "all"
            ).path
        )
    )
    assert "glm4moe.expert_group_count" not in kept.fields


def test_glm4_post_norms_fused_gate_up_and_partial_rotary(tmp_path, sp_tokenizer):
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("glm4", vocab_size=512)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    # interleaved rope in both: q/k rows as transformers holds them
    np.testing.assert_array_equal(t["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(t["blk.0.ffn_up.weight"], hf["model.layers.0.mlp.gate_up_proj.weight"])
    assert {"blk.0.post_attention_norm.weight", "blk.0.post_ffw_norm.weight", "blk.0.attn_q.bias"} <= set(t)
    r = gguf.GGUFReader(str(write_gguf(model, sp_tokenizer, tmp_path / "g").path))
    assert field_value(r, "glm4.rope.dimension_count") == 4  # head_dim 8 x partial_rotary_factor 0.5


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory):
    """The demo's sentencepiece tokenizer (360 pieces: the tiny models below have 512 rows)."""
    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data

    root = tmp_path_factory.mktemp("sp")
    train, _ = write_demo_data(str(root / "data"))
    return train_demo_tokenizer(str(root / "tok"), [train], vocab_size=64)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(position_embedding="alibi"), "ALiBi"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    ],
)
def test_refusals_name_the_reason(kw, needle):
    from bmtrain_cli.export.gguf_arch import check_exportable

    family = "baichuan" if "position_embedding" in kw else "llama"
    with pytest.raises(UserError, match=needle):
        check_exportable(replace(_tiny(family).arch, **kw))


def test_missing_gguf_package_names_the_extra(monkeypatch):
    from bmtrain_cli.export.gguf_export import import_gguf

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(UserError, match=r"bmtrain-cli\[gguf\]"):
        import_gguf()


@pytest.fixture(scope="module")
def sp_run(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("gguf_sp"), "llama", steps=2, vocab_pad=5)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("gguf_bpe"), "qwen2", tokenizer="bpe", steps=2)


def _export(run, out, quantize=None, **kw):
    from bmtrain_cli.export.pipeline import export_checkpoint

    return export_checkpoint(str(run), str(out), fmt="gguf", quantize=quantize, log=lambda m: None, **kw)


def test_sentencepiece_metadata_and_types_read_back(sp_run, tmp_path):
    from bmtrain_cli.data.tokenizers import load_tokenizer

    r = _export(sp_run, tmp_path / "g")
    assert r.quantize == "f16" and r.export_weight_bytes == (tmp_path / "g" / "model.gguf").stat().st_size
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    tok = load_tokenizer(str(sp_run / "checkpoints" / "step-2"))
    assert field_value(reader, "general.architecture") == "llama"
    assert field_value(reader, "llama.block_count") == 2
    assert field_value(reader, "llama.attention.head_count_kv") == 2
    assert field_value(reader, "llama.rope.dimension_count") == 16
    assert field_value(reader, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_F16)
    assert field_value(reader, "tokenizer.ggml.model") == "llama"
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == tok.vocab_size + 5 and tokens[-1] == f"[PAD{tok.vocab_size + 4}]"
    assert tokens[:4] == [tok.id_to_token(i) for i in range(4)]
    types = field_value(reader, "tokenizer.ggml.token_type")
    assert types[tok.eos_id] == gguf.TokenType.CONTROL and types[-1] == gguf.TokenType.UNUSED
    assert types[tok.token_to_id("<0x41>")] == gguf.TokenType.BYTE
    assert field_value(reader, "tokenizer.ggml.eos_token_id") == tok.eos_id
    assert field_value(reader, "tokenizer.ggml.add_space_prefix") is False  # the demo model adds no "▁"
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_norm.weight"] == "F32" and kinds["blk.0.ffn_up.weight"] == "F16"
    assert (tmp_path / "g" / "Modelfile").read_text().startswith("# Ollama Modelfile")


@pytest.mark.parametrize("quantize, tol", [("f16", 2e-3), ("bf16", 1e-2), ("q8_0", 1e-2), ("q4_0", 0.2)])
def test_dequantised_weights_match_the_model(sp_run, tmp_path, quantize, tol):
    from bmtrain_cli.export.gguf_export import gguf_tensors
    from bmtrain_cli.export.loading import load_checkpoint_model

    _export(sp_run, tmp_path / quantize, quantize)
    reader = gguf.GGUFReader(str(tmp_path / quantize / "model.gguf"))
    ours = gguf_tensors(load_checkpoint_model(sp_run / "checkpoints" / "step-2", kernels="reference"))
    kinds = {}
    for t in reader.tensors:
        back = gguf.dequantize(t.data, t.tensor_type).reshape(ours[t.name].shape)
        ref = ours[t.name]
        assert np.abs(back - ref).max() <= tol * np.abs(ref).max(), (t.name, quantize)
        kinds[t.name] = t.tensor_type.name
    assert kinds["output_norm.weight"] == "F32"
    if quantize == "q4_0":  # the output projection stays 8-bit
        assert kinds["output.weight"] == "Q8_0" and kinds["blk.0.attn_q.weight"] == "Q4_0"


def test_byte_level_bpe_vocab_merges_and_chat_template(bpe_run, tmp_path):
    from bmtrain_cli.data.tokenizers import load_tokenizer

    _export(bpe_run, tmp_path / "g", "q8_0")
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    tok = load_tokenizer(str(bpe_run / "checkpoints" / "step-2"))
    assert field_value(reader, "general.architecture") == "qwen2"
    assert field_value(reader, "tokenizer.ggml.model") == "gpt2"
    assert field_value(reader, "tokenizer.ggml.pre") == "qwen2"
    assert field_value(reader, "tokenizer.chat_template") == CHATML
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    im_end = tok.token_to_id("<|im_end|>")
    assert tokens[im_end] == "<|im_end|>" and field_value(reader, "tokenizer.ggml.eos_token_id") == im_end
    assert field_value(reader, "tokenizer.ggml.token_type")[im_end] == gguf.TokenType.CONTROL
    merges = field_value(reader, "tokenizer.ggml.merges")
    assert merges and all(len(m.split(" ")) == 2 for m in merges)
    assert (
        "tokenizer.ggml.bos_token_id" not in reader.fields
        and field_value(reader, "tokenizer.ggml.add_bos_token") is False
    )
    modelfile = (tmp_path / "g" / "Modelfile").read_text()
    assert "FROM ./model.gguf" in modelfile and "<|im_start|>{{ .Role }}" in modelfile
    assert 'PARAMETER stop """<|im_end|>"""' in modelfile and "PARAMETER num_ctx 128" in modelfile


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.gguf_vocab import gguf_vocab
    from tests.unit.export.gguf_models import EXTRA_TEXT, bpe_tokenizer_dir

    tok = load_tokenizer(str(bpe_tokenizer_dir(tmp_path / "t", EXTRA_TEXT * 5, split=r"\p{L}+|\s+|.")))
    with pytest.raises(UserError, match="pre-tokenizer"):
        gguf_vocab(tok, tok.vocab_size)


def test_modelfile_templates():
    from bmtrain_cli.export.modelfile import modelfile_text

    llama3 = "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>' }}{{ m['content'] }}<|eot_id|>"
    text = modelfile_text("model.gguf", llama3, None, "<|end_of_text|>", 8192)
    assert "<|start_header_id|>{{ .Role }}<|end_header_id|>" in text
    assert 'PARAMETER stop """<|end_of_text|>"""' in text and 'PARAMETER stop """<|eot_id|>"""' in text
    odd = modelfile_text("model.gguf", "{{ messages[0]['content'] }}[END]", None, "</s>", 64)
    assert "TEMPLATE" not in odd and "could not be translated" in odd and "embedded in the GGUF" in odd
    builtin = modelfile_text("model.gguf", None, "llama2", "</s>", 64)
    assert "[INST] {{ if .System }}<<SYS>>" in builtin and 'PARAMETER stop """[INST]"""' in builtin
    named = modelfile_text("model.gguf", CHATML, "alpaca", "</s>", 64)  # --template wins over the tokenizer's
    assert "### Instruction:" in named and "im_start" not in named and "SYSTEM" in named
    plain = modelfile_text("model.gguf", None, None, "</s>", 64)
    assert 'TEMPLATE """{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}"""' in plain


def test_quantize_and_template_errors(sp_run, tmp_path):
    with pytest.raises(UserError, match="q8_0"):
        _export(sp_run, tmp_path / "a", "int8")
    with pytest.raises(UserError, match="llama2"):
        _export(sp_run, tmp_path / "b", template="lama2")
    assert not (tmp_path / "b").exists()
    from bmtrain_cli.export.pipeline import export_checkpoint

    with pytest.raises(UserError, match="int8"):
        export_checkpoint(str(sp_run), str(tmp_path / "c"), fmt="hf", quantize="q8_0", log=lambda m: None)


@pytest.mark.slow
def test_cli_gguf_and_quantize_errors(sp_run, tmp_path):
    base = [sys.executable, "-m", "bmtrain_cli", "export", "-c", str(sp_run)]
    r = subprocess.run(
        base + ["-o", str(tmp_path / "a"), "-f", "gguf", "-q", "int8"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "q8_0" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        base + ["-o", str(tmp_path / "b"), "-f", "hf", "-q", "q8_0"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "int8" in r.stderr
    r = subprocess.run(
        base + ["-o", str(tmp_path / "c"), "-f", "gguf", "-q", "q8_0"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "(gguf, q8_0)" in r.stdout and "architecture llama" in r.stdout
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "Modelfile",
        "bmtrain_export.json",
        "model.gguf",
        "tokenizer.model",
        "tokenizer_config.json",
    ]


def test_sentencepiece_model_is_used_beside_a_non_byte_level_tokenizer_json(sp_run, tmp_path):
    """A converted LLaMA 2 / Mistral checkpoint: a Metaspace tokenizer.json (what load_tokenizer picks)
    and the tokenizer.model llama.cpp reads; without the .model file the export says what to add."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    run = tmp_path / "run"
    shutil.copytree(sp_run, run)
    ckpt = run / "checkpoints" / "step-2"
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(
        ["hello world"] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"])
    )
    tok.save(str(ckpt / "tokenizer.json"))
    _export(run, tmp_path / "g")
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert field_value(reader, "tokenizer.ggml.model") == "llama"
    (ckpt / "tokenizer.model").unlink()
    with pytest.raises(UserError, match="tokenizer.model"):
        _export(run, tmp_path / "h")


def test_baichuan_file_metadata(sp_run, tmp_path):
    """Baichuan (RoPE, 32 layers as llama.cpp needs) through the writer, read back with gguf.GGUFReader
    (llama.cpp itself runs it in test_gguf_llama_cpp.py)."""
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.gguf_export import write_gguf

    tok = load_tokenizer(str(sp_run / "checkpoints" / "step-2"))
    summary = write_gguf(
        _tiny("baichuan", vocab_size=tok.vocab_size, num_hidden_layers=32), tok, tmp_path, "q8_0"
    )
    reader = gguf.GGUFReader(str(summary.path))
    assert field_value(reader, "general.architecture") == "baichuan"
    assert field_value(reader, "baichuan.attention.head_count") == 4
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "output.weight"} <= names
    assert not any("W_pack" in n or "attn_qkv" in n for n in names)


def test_gemma2_caps_window_and_norms_are_written(tmp_path, sp_tokenizer):
    """Gemma 2 as llama.cpp's gemma2: (1 + w) norms, tied head, the window, both soft-caps in the metadata."""
    from bmtrain_cli.export.gguf_export import gguf_tensors, write_gguf
    from bmtrain_cli.models import hf_state_dict

    model = _tiny("gemma2", sliding_window=4, query_pre_attn_scalar=8, vocab_size=512)
    t, hf = gguf_tensors(model), hf_state_dict(model)
    np.testing.assert_array_equal(
        t["blk.1.post_attention_norm.weight"], hf["model.layers.1.post_attention_layernorm.weight"] + 1.0
    )
    assert "output.weight" not in t and not any("attn_q_norm" in n for n in t)
    r = gguf.GGUFReader(str(write_gguf(model, sp_tokenizer, tmp_path / "g").path))
    assert field_value(r, "general.architecture") == "gemma2"
    assert field_value(r, "gemma2.attention.sliding_window") == 4
    assert field_value(r, "gemma2.attn_logit_softcapping") == pytest.approx(50.0)
    assert field_value(r, "gemma2.final_logit_softcapping") == pytest.approx(30.0)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(layer_types=("full_attention", "sliding_attention")), "even layers sliding"),
        (dict(attn_logit_softcapping=None), "always soft-caps"),
        (dict(final_logit_softcapping=None), "always soft-caps"),
        (dict(query_pre_attn_scalar=64.0), "query_pre_attn_scalar"),
    ],
)
def test_what_llama_cpp_fixes_for_gemma2_is_refused_when_the_model_differs(kw, needle):
    from bmtrain_cli.export.gguf_arch import check_exportable

    assert check_exportable(_tiny("gemma2", query_pre_attn_scalar=8).arch) == "gemma2"
    with pytest.raises(UserError, match=needle):
        check_exportable(replace(_tiny("gemma2", query_pre_attn_scalar=8).arch, **kw))
