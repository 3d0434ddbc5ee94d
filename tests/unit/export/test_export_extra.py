"""Tied embeddings under INT8, and (slow) the hf export loaded by transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bmtrain_cli.export.loading import load_for_inference
from bmtrain_cli.export.pipeline import export_checkpoint
from tests.unit.export.conftest import make_checkpoint

IDS = np.random.default_rng(1).integers(3, 250, (2, 11)).astype(np.int64)


def test_tied_embeddings_int8_both_formats(tmp_path):
    run = make_checkpoint(tmp_path / "tied", steps=3, tie=True)
    ref = load_for_inference(str(run)).logits(IDS)
    outs = {}
    for fmt in ("paddle-inference", "hf"):
        r = export_checkpoint(str(run), str(tmp_path / fmt), fmt=fmt, quantize="int8", log=lambda m: None)
        assert "lm_head" not in r.quantized_linear and r.quantized_embedding == ["model.embed_tokens"]
        outs[fmt] = load_for_inference(str(r.output)).logits(IDS)
    np.testing.assert_allclose(outs["paddle-inference"], outs["hf"], atol=1e-4)
    assert 0 < np.abs(outs["hf"] - ref).max() < 0.1


def _reference_python():
    """A Python with torch + transformers: this one, or $BMTRAIN_REF_PYTHON."""
    try:
        import transformers  # noqa: F401

        return sys.executable
    except ImportError:
        ref = os.environ.get("BMTRAIN_REF_PYTHON")
        return ref if ref and Path(ref).exists() else None


@pytest.mark.slow
def test_transformers_loads_hf_export(trained_run, tmp_path):
    py = _reference_python()
    if py is None:
        pytest.skip("transformers not importable (set BMTRAIN_REF_PYTHON to a Python that has it)")
    out = tmp_path / "hf"
    export_checkpoint(str(trained_run), str(out), fmt="hf", log=lambda m: None)
    np.save(tmp_path / "ids.npy", IDS)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "d, t = sys.argv[1], sys.argv[2]\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()\n"
        "tok = transformers.AutoTokenizer.from_pretrained(d)\n"
        "ids = torch.from_numpy(np.load(t + '/ids.npy'))\n"
        "with torch.no_grad(): out = m(input_ids=ids).logits.numpy()\n"
        "np.save(t + '/hf_logits.npy', out)\n"
        "print(tok.encode('12+35='))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(
        [py, "-c", script, str(out), str(tmp_path)], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = np.load(tmp_path / "hf_logits.npy")
    ours = load_for_inference(str(out)).logits(IDS)
    assert np.abs(theirs - ours).max() <= 1e-4
