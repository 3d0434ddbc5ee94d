"""The int8 input embedding and LM head (quant/vocab.py): the lookup and the vocabulary-chunked loss equal
the same computation on the dequantised weights to fp32 round-off, forward and input gradient; a model
with them quantised (tied and untied) gives the loss of its dequantised twin, one set of codes when tied."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.config.schema import ModelConfig, QuantizationConfig
from bmtrain_cli.models import build, load_pretrained, save_pretrained
from bmtrain_cli.ops import reference
from bmtrain_cli.quant import vocab
from bmtrain_cli.quant.layer import QuantLinear, quantize_model, quantized_layers

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def _embedding(rows: int, hidden: int, seed: int = 0) -> vocab.QuantEmbedding:
    w = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return vocab.QuantEmbedding(w, "float32")


def test_lookup_gathers_the_dequantised_rows() -> None:
    emb = _embedding(301, 24)
    ids = paddle.to_tensor(np.random.default_rng(1).integers(0, 301, (3, 7)))
    whole = emb.dequantized_weight().numpy()
    np.testing.assert_array_equal(emb(ids).numpy(), whole[ids.numpy()])
    w = np.random.default_rng(0).standard_normal((301, 24)).astype(np.float32)
    assert np.abs(whole - w).max() <= np.abs(w).max(axis=1).max() / 127 / 2 * 1.0001  # int8's half step


@pytest.mark.parametrize(
    "rows, hidden, tokens, chunk", [(1000, 48, 37, 3700), (257, 33, 5, 500), (64, 16, 9, 9)]
)
def test_chunked_loss_equals_the_dequantised_head(monkeypatch, rows, hidden, tokens, chunk) -> None:
    """Many vocabulary chunks (chunk logits / tokens rows each, an odd last one), ignored labels."""
    monkeypatch.setattr(vocab, "CHUNK_LOGITS", chunk)
    emb = _embedding(rows, hidden)
    head = emb.vocab_codes()
    assert len(list(head.chunks(tokens))) > 1
    rng = np.random.default_rng(2)
    h = rng.standard_normal((tokens, hidden)).astype(np.float32)
    labels = rng.integers(0, rows, tokens)
    labels[1] = -100
    x = paddle.to_tensor(h, stop_gradient=False)
    total, count = vocab.head_cross_entropy(head, x, paddle.to_tensor(labels))
    (total * 0.5).backward()
    y = paddle.to_tensor(h, stop_gradient=False)
    want, want_count = reference.linear_cross_entropy(
        y, emb.dequantized_weight(), paddle.to_tensor(labels), transpose_weight=True
    )
    (want * 0.5).backward()
    assert float(count) == float(want_count) == tokens - 1
    np.testing.assert_allclose(float(total), float(want), rtol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), y.grad.numpy(), rtol=1e-4, atol=1e-5)
    with paddle.no_grad():
        np.testing.assert_allclose(
            float(vocab.head_cross_entropy(head, x, paddle.to_tensor(labels))[0]), float(want), rtol=1e-5
        )
        logits = head.logits(paddle.to_tensor(h))
    np.testing.assert_allclose(logits.numpy(), h @ emb.dequantized_weight().numpy().T, rtol=1e-5, atol=1e-5)


def _twin(model, kwargs) -> object:
    """The same model unquantised, holding the quantised model's dequantised weights."""
    plain = build(ModelConfig(kernels="reference", **kwargs))
    state = plain.state_dict()
    for name, layer in quantized_layers(model):
        state[f"{name}.weight"].set_value(layer.dequantized_weight())
    for name, value in model.state_dict().items():
        state[name].set_value(value)
    return plain


@pytest.mark.parametrize("tied, method", [(True, "int8"), (False, "int8"), (False, "nf4")])
def test_model_loss_equals_its_dequantised_twin(tmp_path, tied, method) -> None:
    """The embedding and the head in int8 beside int8 or nf4 linear layers (the head is int8 either way)."""
    kwargs = dict(vocab_size=300, tie_word_embeddings=tied, **TINY)
    settings = QuantizationConfig(
        method=method, block_size=32 if method == "nf4" else None, skip_modules=["norm"]
    )
    save_pretrained(build(ModelConfig(kernels="reference", **kwargs)), tmp_path)
    model = load_pretrained(tmp_path, quantization=settings, kernels="reference")
    after = load_pretrained(tmp_path, kernels="reference")
    quantize_model(after, settings, "reference")
    names = dict(quantized_layers(model))
    assert isinstance(model.model.embed_tokens, vocab.QuantEmbedding)
    assert ("lm_head" in names) == (not tied) and (model.lm_head is None) == tied
    if not tied:
        assert isinstance(model.lm_head, QuantLinear) and model.lm_head.method == "int8"
    assert {m.method for n, m in names.items() if "layers." in n} == {method}
    for name, layer in names.items():  # quantised while read == quantised after
        np.testing.assert_array_equal(layer.codes.numpy(), dict(quantized_layers(after))[name].codes.numpy())
    assert not any("embed_tokens" in k or "lm_head" in k for k in model.state_dict())
    twin = _twin(model, kwargs)
    ids = paddle.to_tensor(np.random.default_rng(3).integers(0, 300, (2, 11)))
    labels = ids.clone()
    labels[0, :3] = -100
    for m in (model, twin):
        m.train()
    got, _ = model.loss_sum(ids, labels)
    want, _ = twin.loss_sum(ids, labels)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    with paddle.no_grad():
        np.testing.assert_allclose(model(ids).numpy(), twin(ids).numpy(), rtol=1e-4, atol=1e-5)


def test_quantised_in_row_blocks_equals_quantising_the_whole_matrix(monkeypatch) -> None:
    """Blocks of 7 rows (an odd last block) give the bytes of formats.py's int8 of the whole matrix."""
    from bmtrain_cli.quant import formats

    w = np.random.default_rng(5).standard_normal((303, 40)).astype(np.float32) * 3
    w[17] = 0.0  # an all-zero row
    monkeypatch.setattr(vocab, "ROW_BLOCK_WEIGHTS", 7 * 40 + 3)
    reads = []

    def read(r0, r1):
        reads.append((r0, r1))
        return w[r0:r1]

    emb = vocab.QuantEmbedding((read, 303, 40), "float32")
    whole = formats.quantize(w, "int8")
    assert len(reads) == 44 and reads[-1] == (301, 303)
    assert emb.codes.numpy().tobytes() == whole.codes.tobytes()
    assert emb.scales.numpy().tobytes() == whole.scales.tobytes()
    assert emb.nbytes == whole.nbytes
    np.testing.assert_array_equal(emb.codes.numpy(), vocab.QuantEmbedding(w, "float32").codes.numpy())


def test_loading_reads_the_int8_embedding_from_the_file_in_row_blocks(tmp_path, monkeypatch) -> None:
    """The embedding is never read whole: its codes are those of the saved tensor quantised in one piece."""
    from bmtrain_cli.models.safetensors_io import SafetensorsFile
    from bmtrain_cli.quant import formats

    save_pretrained(build(ModelConfig(vocab_size=300, kernels="reference", **TINY)), tmp_path)
    saved = {n: p.numpy() for n, p in load_pretrained(tmp_path, kernels="reference").named_parameters()}
    monkeypatch.setattr(vocab, "ROW_BLOCK_WEIGHTS", 64 * 64)
    whole_reads = []
    get = SafetensorsFile.get
    monkeypatch.setattr(
        SafetensorsFile, "get", lambda self, name: whole_reads.append(name) or get(self, name)
    )
    q = QuantizationConfig(method="nf4", block_size=32, skip_modules=["norm", "gate"])
    model = load_pretrained(tmp_path, quantization=q, kernels="reference")
    assert not any("embed_tokens" in n for n in whole_reads) and whole_reads
    emb = model.model.embed_tokens
    assert isinstance(emb, vocab.QuantEmbedding)
    want = formats.quantize(saved["model.embed_tokens.weight"], "int8")
    assert emb.codes.numpy().tobytes() == want.codes.tobytes()
    assert emb.scales.numpy().tobytes() == want.scales.tobytes()
