"""Exports of a tiny trained model: predictor vs dygraph, hf round trip, INT8 size and eval loss."""

from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from bmtrain_cli.data.encode import encode_eval_file
from bmtrain_cli.export.loading import load_for_inference
from bmtrain_cli.export.pipeline import export_checkpoint
from bmtrain_cli.models import load_pretrained
from bmtrain_cli.models.scoring import logits_loss

IDS_A = np.array([[1, 5, 6, 7, 8, 9, 10, 11]], dtype=np.int64)
IDS_B = np.random.default_rng(0).integers(3, 250, (3, 13)).astype(np.int64)


def _ckpt(run):
    return run / "checkpoints" / "step-60"


def _dygraph_logits(model, ids):
    with paddle.no_grad():
        return model(paddle.to_tensor(ids)).numpy()


@pytest.fixture(scope="module")
def exports(trained_run, heldout, tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    results = {}
    for fmt in ("paddle-inference", "hf"):
        for q in (None, "int8"):
            results[(fmt, q)] = export_checkpoint(
                str(trained_run),
                str(out / f"{fmt}-{q}"),
                fmt=fmt,
                quantize=q,
                eval_data=heldout,
                log=lambda m: None,
            )
    return results


def test_paddle_inference_predictor_matches_dygraph(trained_run, exports):
    from paddle import inference

    out = exports[("paddle-inference", None)].output
    graph = out / "model.json" if (out / "model.json").is_file() else out / "model.pdmodel"
    config = inference.Config(str(graph), str(out / "model.pdiparams"))
    config.disable_gpu()
    predictor = inference.create_predictor(config)
    assert predictor.get_input_names() == ["input_ids"]
    model = load_pretrained(str(_ckpt(trained_run)))
    for ids in (IDS_A, IDS_B):  # dynamic batch and sequence
        handle = predictor.get_input_handle("input_ids")
        handle.reshape(list(ids.shape))
        handle.copy_from_cpu(ids)
        predictor.run()
        got = predictor.get_output_handle(predictor.get_output_names()[0]).copy_to_cpu()
        ref = _dygraph_logits(model, ids)
        assert got.shape == ref.shape == (*ids.shape, model.arch.vocab_size)
        assert np.abs(got - ref).max() <= 1e-4
    for f in ("tokenizer.model", "tokenizer_config.json", "config.json", "bmtrain_export.json"):
        assert (out / f).is_file(), f


def test_hf_export_reloads_equal(trained_run, exports):
    out = exports[("hf", None)].output
    src = load_pretrained(str(_ckpt(trained_run)))
    back = load_pretrained(str(out))
    a, b = src.state_dict(), back.state_dict()
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())
    np.testing.assert_array_equal(_dygraph_logits(src, IDS_B), _dygraph_logits(back, IDS_B))
    assert (out / "tokenizer.model").is_file()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("fmt", ["paddle-inference", "hf"])
def test_int8_size_and_eval_loss(exports, fmt):
    r = exports[(fmt, "int8")]
    fp32 = exports[(fmt, None)]
    assert r.size_ratio <= 0.3, r.size_ratio
    # measured on the files: the int8 export is at most 0.3x the fp32 export of the same model
    assert r.export_weight_bytes <= 0.3 * fp32.export_weight_bytes
    assert r.eval_records == 200 and r.eval_loss_fp32 is not None
    assert abs(r.eval_loss_change) <= 0.02, r.to_dict()
    assert r.eval_loss_quantized != r.eval_loss_fp32  # the quantised model really ran
    assert len(r.quantized_linear) == 2 * 7 + 1 and r.quantized_embedding == ["model.embed_tokens"]
    cfg = json.loads((r.output / "config.json").read_text())
    assert cfg["quantization_config"]["bits"] == 8


def test_int8_exports_agree_and_load_back(trained_run, exports, heldout):
    pi = load_for_inference(str(exports[("paddle-inference", "int8")].output))
    hf = load_for_inference(str(exports[("hf", "int8")].output))
    assert pi.format == "paddle-inference" and pi.quantized
    assert hf.format == "hf" and hf.quantized
    # int8 stays int8 in the hf files
    from safetensors.numpy import load_file

    tensors = load_file(str(exports[("hf", "int8")].output / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # HF [out, in]
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64,)
    assert tensors["model.norm.weight"].dtype == np.float32
    np.testing.assert_allclose(pi.logits(IDS_B), hf.logits(IDS_B), atol=1e-4)
    samples = encode_eval_file(heldout, hf.tokenizer, max_records=200)
    assert logits_loss(hf.logits, samples)[0] == pytest.approx(
        exports[("hf", "int8")].eval_loss_quantized, rel=1e-5
    )
    full = load_for_inference(str(trained_run))
    assert full.format == "checkpoint" and not full.quantized
    diff = np.abs(full.logits(IDS_B) - hf.logits(IDS_B)).max()
    assert 0 < diff < 0.5


def test_fp32_formats_open_for_inference(trained_run, exports):
    ref = load_for_inference(str(trained_run)).logits(IDS_A)
    for fmt in ("paddle-inference", "hf"):
        m = load_for_inference(str(exports[(fmt, None)].output))
        assert m.tokenizer is not None and m.tokenizer.vocab_size == ref.shape[-1]
        assert np.abs(m.logits(IDS_A) - ref).max() <= 1e-4
