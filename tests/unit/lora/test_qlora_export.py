"""`bmtrain export` of a QLoRA checkpoint (LoRA on a quantised base): merged onto the dequantised base it
trained on, in the base's dtype, with the quantisation error of the merged weights measured and recorded;
--format paddle-inference of the merged model; --no-merge adapters that PEFT loads on the original base."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import load_file
from typer.testing import CliRunner

from bmtrain_cli.lora import load_lora_checkpoint
from bmtrain_cli.lora.inject import lora_layers
from tests.unit.lora.conftest import lora_cfg, tiny_model, write_lora_ckpt


def _logits(model, ids):
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).astype("float32").numpy()


def _export(*args):
    from bmtrain_cli.cli import app

    r = CliRunner().invoke(app, ["export", *args])
    return r, (r.stdout or "") + (getattr(r, "stderr", "") or "")


def _qlora_ckpt(tmp_path: Path, method: str, dtype: str = "float32", **extra) -> dict:
    """A base on disk (in ``dtype``), a LoRA model on it quantised in ``method`` while read (as training
    builds it), random adapters, and the checkpoint the trainer's writer makes of it (+ a tokenizer)."""
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.models import load_pretrained, save_pretrained

    base_dir = tmp_path / "base"
    save_pretrained(tiny_model().to(dtype=dtype), base_dir)
    quant = {"method": method} if method == "int8" else {"method": method, "block_size": 32}
    quant.update(extra)
    cfg = Config.model_validate(
        {
            "model_config": {"model_name_or_path": str(base_dir), "quantization": quant},
            "train_config": lora_cfg(["q_proj", "v_proj", "down_proj"]).model_dump(),
        }
    )
    model = load_pretrained(base_dir, kernels="reference", quantization=cfg.model.quantization)
    _, ckpt = write_lora_ckpt(model, cfg, tmp_path)
    return {"base": base_dir, "ckpt": ckpt, "model": model}


@pytest.fixture
def ids():
    return np.random.default_rng(3).integers(0, 96, (2, 12))


def _exact_merged(base: Path, trained) -> dict:
    """Original base weights + adapters, HF names and [out, in] layout, computed here independently."""
    weights = load_file(str(base / "model.safetensors"))
    out = {}
    for name, layer in lora_layers(trained):
        a = layer.lora_A.weight.numpy().astype(np.float64)
        b = layer.lora_B.weight.numpy().astype(np.float64)
        out[f"{name}.weight"] = weights[f"{name}.weight"].astype(np.float64) + (a @ b).T * layer.scaling
    return out


@pytest.mark.parametrize("method", ["nf4", "int8"])
def test_merged_export_is_the_trained_model_and_records_the_error(method, tmp_path, ids):
    made = _qlora_ckpt(tmp_path, method)
    record = json.loads((made["ckpt"] / "lora_base.json").read_text())
    assert record["quantization"]["method"] == method
    out = tmp_path / "merged"
    r, text = _export("-c", str(made["ckpt"]), "-o", str(out), "--format", "hf")
    assert r.exit_code == 0, text
    assert f"merged onto the {method}-dequantised base" in text, text

    from bmtrain_cli.models import load_pretrained

    # the merged model computes what the model trained on the quantised base computed
    trained = _logits(made["model"], ids)
    np.testing.assert_allclose(_logits(load_pretrained(out, kernels="reference"), ids), trained, atol=1e-4)
    # ...and not what the original base + adapters compute (the quantisation error is real)
    original = _logits(load_lora_checkpoint(made["ckpt"], merge=True, kernels="reference"), ids)
    assert np.abs(original - trained).max() > 1e-3

    # the recorded error is the one of the merged weights as written, against original base + adapters
    meta = json.loads((out / "bmtrain_export.json").read_text())["report"]["quantized_base"]
    written = load_file(str(out / "model.safetensors"))
    exact = _exact_merged(made["base"], made["model"])
    base = load_file(str(made["base"] / "model.safetensors"))
    quantised = [n for n in written if n.endswith("_proj.weight")]
    assert meta["layers"] == len(quantised) == 2 * 7
    sq_err = sq_ref = 0.0
    max_abs = 0.0
    for name in quantised:
        want = exact.get(name, base[name].astype(np.float64))
        diff = written[name].astype(np.float64) - want
        sq_err, sq_ref = sq_err + (diff**2).sum(), sq_ref + (want**2).sum()
        max_abs = max(max_abs, np.abs(diff).max())
    assert meta["relative"] == pytest.approx((sq_err / sq_ref) ** 0.5, rel=1e-4)
    assert meta["max_abs"] == pytest.approx(max_abs, rel=1e-4)
    assert 0.001 < meta["relative"] < (0.15 if method == "nf4" else 0.02)


def test_merged_export_with_the_embedding_and_head_in_int8(tmp_path, ids):
    """skip_modules without embed_tokens / lm_head: the merged model holds their dequantised int8 values
    and computes what the trained model computed."""
    made = _qlora_ckpt(tmp_path, "nf4", skip_modules=["norm", "gate"])
    assert type(made["model"].model.embed_tokens).__name__ == "QuantEmbedding"
    out = tmp_path / "merged"
    r, text = _export("-c", str(made["ckpt"]), "-o", str(out), "--format", "hf")
    assert r.exit_code == 0, text
    from bmtrain_cli.models import load_pretrained

    np.testing.assert_allclose(
        _logits(load_pretrained(out, kernels="reference"), ids), _logits(made["model"], ids), atol=1e-4
    )
    written = load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"]
    original = load_file(str(made["base"] / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(written, made["model"].model.embed_tokens.dequantized_weight().numpy())
    assert 0 < np.abs(written - original).max() <= np.abs(original).max() / 127


def test_bf16_base_is_merged_back_into_bf16(tmp_path, ids):
    made = _qlora_ckpt(tmp_path, "nf4", dtype="bfloat16")
    out = tmp_path / "merged"
    r, text = _export("-c", str(made["ckpt"]), "-o", str(out), "--format", "hf")
    assert r.exit_code == 0, text
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with open(out / "model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert "in the base's bfloat16" in text
    meta = json.loads((out / "bmtrain_export.json").read_text())["report"]["quantized_base"]
    assert meta["dtype"] == "bfloat16" and 0.001 < meta["relative"] < 0.15


def test_paddle_inference_export_of_the_merged_model(tmp_path, ids):
    from bmtrain_cli.export.loading import load_for_inference

    made = _qlora_ckpt(tmp_path, "nf4")
    out = tmp_path / "served"
    r, text = _export("-c", str(made["ckpt"]), "-o", str(out), "--format", "paddle-inference")
    assert r.exit_code == 0, text
    served = load_for_inference(str(out))
    assert served.format == "paddle-inference"
    np.testing.assert_allclose(served.logits(ids), _logits(made["model"], ids), atol=1e-4)


PEFT_SCRIPT = """
import sys, numpy as np, torch, transformers, peft
base, adapters, ids = sys.argv[1], sys.argv[2], sys.argv[3]
m = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
m = peft.PeftModel.from_pretrained(m, adapters).eval()
with torch.no_grad():
    logits = m(input_ids=torch.from_numpy(np.load(ids))).logits
np.save(ids + ".logits.npy", logits.numpy())
"""


def test_no_merge_adapters_load_with_peft_on_the_original_base(tmp_path, ids):
    made = _qlora_ckpt(tmp_path, "nf4")
    out = tmp_path / "peft"
    r, text = _export("-c", str(made["ckpt"]), "-o", str(out), "--format", "hf", "--no-merge")
    assert r.exit_code == 0, text
    assert not list(out.glob("model*.safetensors"))
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    if not ref or not Path(ref).exists():
        pytest.skip("BMTRAIN_REF_PYTHON (transformers + peft) is not set")
    np.save(tmp_path / "ids.npy", ids)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    res = subprocess.run(
        [ref, "-c", PEFT_SCRIPT, str(made["base"]), str(out), str(tmp_path / "ids.npy")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    peft_logits = np.load(tmp_path / "ids.npy.logits.npy")
    ours = _logits(load_lora_checkpoint(made["ckpt"], merge=True, kernels="reference"), ids)
    np.testing.assert_allclose(peft_logits, ours, atol=1e-4, rtol=0)
