"""save_pretrained / load_pretrained: sharding, dtypes, safetensors compatibility, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import paddle
import pytest

from bmtrain_cli.errors import UserError
from bmtrain_cli.models import build, load_pretrained, save_pretrained
from bmtrain_cli.models.arch import read_hf_config
from bmtrain_cli.models.families import family
from bmtrain_cli.models.hf import _local_slice
from bmtrain_cli.models.safetensors_io import SafetensorsFile, fp32_to_bf16_bits, write_safetensors
from tests.unit.models.tiny import TINY

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"


def _ids():
    return paddle.to_tensor(np.random.default_rng(0).integers(0, 97, [2, 7]), dtype="int64")


def test_sharded_save_writes_index_and_reloads(tmp_path):
    paddle.seed(0)
    m = build(TINY)
    m.eval()
    files = save_pretrained(m, tmp_path, max_shard_size_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (tmp_path / "model.safetensors").exists()
    assert index["metadata"]["total_size"] == sum(int(np.prod(p.shape)) * 4 for p in m.parameters())
    assert {p.name for p in files} >= set(shards) | {"config.json", "model.safetensors.index.json"}
    again = load_pretrained(tmp_path)
    np.testing.assert_array_equal(again(_ids()).numpy(), m(_ids()).numpy())
    # saving again unsharded removes the stale shards and index
    save_pretrained(m, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_config_round_trip_keeps_architecture_and_unknown_keys(tmp_path):
    src = FIXTURES / "qwen2"
    m = load_pretrained(src)
    save_pretrained(m, tmp_path)
    assert read_hf_config(str(tmp_path)) == read_hf_config(str(src))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["use_sliding_window"] is False  # an unknown key, written back as it was


def test_rope_theta_from_either_key(tmp_path):
    base = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    assert read_hf_config(str(FIXTURES / "qwen3")).rope_theta == 1e6  # 5.x: rope_parameters.rope_theta
    old = {k: v for k, v in base.items() if k != "rope_parameters"}
    old["rope_theta"] = 5e5  # 4.x key
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert read_hf_config(str(tmp_path)).rope_theta == 5e5


def test_bfloat16_save_and_load(tmp_path):
    paddle.seed(0)
    m = build(TINY, dtype="bfloat16")
    assert all(p.dtype == paddle.bfloat16 for p in m.parameters())
    save_pretrained(m, tmp_path)
    f = SafetensorsFile(tmp_path / "model.safetensors")
    assert {f.header[n]["dtype"] for n in f.names()} == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = load_pretrained(tmp_path, dtype="bfloat16")
    for (n, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        np.testing.assert_array_equal(a.astype("float32").numpy(), b.astype("float32").numpy(), err_msg=n)
    fp32 = load_pretrained(tmp_path)  # default dtype: float32
    assert all(p.dtype == paddle.float32 for p in fp32.parameters())


def test_our_files_read_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, dtype=np.int64)}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    back = load_file(str(tmp_path / "x.safetensors"))
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)
    bits = fp32_to_bf16_bits(np.array([1.0, -2.5, 3.140625], dtype=np.float32))
    np.testing.assert_array_equal(bits, [0x3F80, 0xC020, 0x4049])


def test_clear_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    with pytest.raises(UserError, match="no config.json"):
        load_pretrained(tmp_path)
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_gqa_llama3", d)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(UserError, match="pickle"):
        load_pretrained(d)
    # a checkpoint missing a tensor names it
    f = SafetensorsFile(d / "pytorch_model.bin")
    tensors = {n: f.get(n) for n in f.names() if n != "model.norm.weight"}
    write_safetensors(d / "model.safetensors", tensors)
    with pytest.raises(UserError, match="model.norm.weight"):
        load_pretrained(d)
    bad = json.loads((d / "config.json").read_text())
    bad["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(bad))
    with pytest.raises(UserError, match="gpt2"):
        load_pretrained(d)


def test_tensor_parallel_slices():
    class Fake:
        tp_degree, tp_rank = 2, 1

    full = np.arange(24).reshape(4, 6)
    np.testing.assert_array_equal(_local_slice(full, [4, 3], Fake(), "x"), full[:, 3:])
    np.testing.assert_array_equal(_local_slice(full, [2, 6], Fake(), "x"), full[2:])
    with pytest.raises(UserError):
        _local_slice(full, [3, 6], Fake(), "x")


def _fresh(name: str, **changes):
    """TINY in a family's shape (its defaults), with ``changes``."""
    return replace(TINY, family=name, **{**family(name).defaults, **changes})


def _reference_python():
    """A Python with torch + transformers: this one, or $BMTRAIN_REF_PYTHON (e.g. /tmp/refvenv/bin/python)."""
    try:
        import transformers  # noqa: F401

        return sys.executable
    except ImportError:
        ref = os.environ.get("BMTRAIN_REF_PYTHON")
        return ref if ref and Path(ref).exists() else None


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch",
    [
        TINY,
        replace(TINY, family="qwen2", attention_bias=True, tie_word_embeddings=True, rope_theta=1e6),
        replace(TINY, family="qwen3", qk_norm=True, head_dim=32),
        replace(TINY, family="mistral", sliding_window=4),
        replace(
            TINY,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
        _fresh("ernie4_5", attention_bias=True, mlp_bias=True),
        _fresh(
            "gemma3_text",
            sliding_window=4,
            query_pre_attn_scalar=12.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        _fresh("glm4"),
        _fresh(
            "phi3",
            partial_rotary_factor=0.75,
            rope_scaling={
                "rope_type": "longrope",
                "original_max_position_embeddings": 8,
                "long_factor": [1.0 + i / 5 for i in range(6)],
                "short_factor": [1.0 + i / 20 for i in range(6)],
            },
        ),
        _fresh("qwen3_moe", num_experts=4, moe_intermediate_size=24, mlp_only_layers=(0,), head_dim=32),
        _fresh("mixtral", num_experts=4, moe_intermediate_size=24, sliding_window=4),
        _fresh("ernie4_5_moe", num_experts=4, moe_intermediate_size=24, head_dim=32),
        _fresh(
            "glm4_moe",
            num_experts=8,
            moe_intermediate_size=24,
            head_dim=32,
            qk_norm=True,
            moe_groups=4,
            moe_topk_groups=2,
            routed_scaling_factor=2.5,
        ),
    ],
    ids=[
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "llama3rope",
        "ernie4_5",
        "gemma3_text",
        "glm4",
        "phi3",
        "qwen3_moe",
        "mixtral",
        "ernie4_5_moe",
        "glm4_moe",
    ],
)
def test_transformers_loads_our_checkpoint(arch, tmp_path):
    py = _reference_python()
    if py is None:
        pytest.skip("transformers not importable (set BMTRAIN_REF_PYTHON to a Python that has it)")
    paddle.seed(0)
    m = build(arch)
    m.eval()
    for p in m.parameters():  # norms and biases away from their 1 / 0 starts, so a misread one shows
        if len(p.shape) == 1:
            p.set_value(paddle.randn(p.shape) * 0.3 + (1.0 if not arch.norm_offset else 0.0))
    save_pretrained(m, tmp_path)
    ids = np.random.default_rng(0).integers(0, 97, [2, 9])
    np.save(tmp_path / "ids.npy", ids)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "d = sys.argv[1]\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()\n"
        "ids = torch.from_numpy(np.load(d + '/ids.npy'))\n"
        "with torch.no_grad(): out = m(input_ids=ids).logits.numpy()\n"
        "np.save(d + '/hf_logits.npy', out)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(
        [py, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = np.load(tmp_path / "hf_logits.npy")
    ours = m(paddle.to_tensor(ids)).numpy()
    assert np.abs(theirs - ours).max() <= 1e-4


def test_truncated_weights_are_a_clear_error(tmp_path):
    """A safetensors file cut short (an interrupted copy) is a UserError naming the file, not a numpy
    reshape traceback from deep inside the loader."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_gqa_llama3", d)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(UserError, match="truncated"):
        load_pretrained(d)


def test_a_fused_w_pack_checkpoint_reloads_into_the_fused_model(tmp_path):
    """Baichuan keeps W_pack fused on one device: a saved checkpoint loads back unsplit, same logits."""
    paddle.seed(0)
    m = build(replace(TINY, family="baichuan", fused_qkv=True, num_key_value_heads=TINY.num_attention_heads))
    m.eval()
    save_pretrained(m, tmp_path)
    again = load_pretrained(tmp_path)
    assert any(n.endswith("W_pack.weight") for n in again.state_dict())
    np.testing.assert_array_equal(again(_ids()).numpy(), m(_ids()).numpy())
