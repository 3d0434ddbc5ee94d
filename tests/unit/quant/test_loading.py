"""A checkpoint quantised while it is read (models/hf.py load_pretrained(quantization=...)): the same codes
and logits as loading it whole and quantising afterwards, the skipped layers untouched, and a peak host
memory near the quantised size rather than the full-precision model's."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import paddle

from bmtrain_cli.config.schema import ModelConfig, QuantizationConfig
from bmtrain_cli.models import build, load_pretrained, save_pretrained
from bmtrain_cli.quant.layer import QuantLinear, quantize_model, quantized_layers

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


def test_quantised_while_read_equals_quantised_after(tmp_path) -> None:
    save_pretrained(build(ModelConfig(vocab_size=128, kernels="reference", **TINY)), tmp_path)
    q = QuantizationConfig(
        method="int4", block_size=32, skip_modules=["embed_tokens", "lm_head", "down_proj"]
    )
    read = load_pretrained(tmp_path, quantization=q, kernels="reference")
    after = load_pretrained(tmp_path, kernels="reference")
    quantize_model(after, q, "reference")
    got, want = dict(quantized_layers(read)), dict(quantized_layers(after))
    assert sorted(got) == sorted(want) and len(got) == 2 * 6  # 6 projections a layer, down_proj skipped
    assert not isinstance(read.lm_head, QuantLinear) and not any("down_proj" in n for n in got)
    for name, layer in got.items():
        np.testing.assert_array_equal(layer.codes.numpy(), want[name].codes.numpy())
        np.testing.assert_array_equal(layer.scales.numpy(), want[name].scales.numpy())
    ids = paddle.to_tensor([[1, 5, 9, 2, 7]])
    with paddle.no_grad():
        np.testing.assert_array_equal(read(ids).numpy(), after(ids).numpy())


PEAK = textwrap.dedent(
    """
    import sys
    from bmtrain_cli.config.schema import QuantizationConfig
    from bmtrain_cli.models import load_pretrained
    import paddle

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    q = QuantizationConfig(method="nf4") if sys.argv[2] == "nf4" else None
    paddle.zeros([8, 8]).numpy()  # the allocator's first arena
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak (VmHWM) to the current RSS
    before = status("VmRSS")
    model = load_pretrained(sys.argv[1], quantization=q, kernels="reference")
    print(status("VmHWM") - before)
    """
)


def test_peak_host_memory_while_loading_stays_near_the_quantised_size(tmp_path) -> None:
    # 4 layers of h768 / ffn 2048: at most 28.3 M projection weights (108 MiB fp32, 15 MiB in nf4)
    cfg = dict(TINY, hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12)
    save_pretrained(build(ModelConfig(vocab_size=256, kernels="reference", **cfg)), tmp_path)
    grown = {}
    for kind in ("fp32", "nf4"):
        r = subprocess.run(
            [sys.executable, "-c", PEAK, str(tmp_path), kind], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        grown[kind] = int(r.stdout.split()[-1])
    projections = 4 * (4 * 768 * 768 + 3 * 768 * 2048)
    assert grown["fp32"] > 0.9 * projections * 4, grown
    # the codes and scales (4.5 bits a weight), the unquantised embeddings and head, and the temporaries of
    # quantising one tensor at a time (a few copies of the largest, one 768 x 2048 fp32 matrix)
    quantised = projections * 4.5 / 8 + 2 * 256 * 768 * 4
    assert grown["nf4"] < quantised + 8 * 768 * 2048 * 4, grown
    assert grown["nf4"] < 0.5 * grown["fp32"], grown


VOCAB_PEAK = PEAK.replace(
    'q = QuantizationConfig(method="nf4") if sys.argv[2] == "nf4" else None',
    "from bmtrain_cli.quant import layer, vocab\n"
    'q = QuantizationConfig(method="nf4", skip_modules=["norm", "gate"])\n'
    "vocab.ROW_BLOCK_WEIGHTS = 1 << 18\n"
    'if sys.argv[2] == "whole":  # the matrix read whole and quantised in one piece\n'
    "    vocab.ROW_BLOCK_WEIGHTS = 1 << 40\n"
    "    layer.Quantizer.take_rows = lambda *args: False",
)


def _grown_whole_and_rows(script: str, path) -> dict:
    """{"whole", "rows"}: how much ``script`` (a PEAK variant) grows the process loading ``path``."""
    grown = {}
    for kind in ("whole", "rows"):
        r = subprocess.run(
            [sys.executable, "-c", script, str(path), kind], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        grown[kind] = int(r.stdout.split()[-1])
    return grown


def test_the_int8_embedding_is_quantised_as_it_is_read_so_loading_peaks_near_its_codes(tmp_path) -> None:
    """A tied 32000 x 256 embedding (31.25 MiB in fp32, 7.8 MiB in int8) read a block of 256Ki weights at a
    time: the load grows the process by about its codes, not by the fp32 matrix and its temporaries."""
    cfg = dict(TINY, hidden_size=256, intermediate_size=256, num_hidden_layers=1, tie_word_embeddings=True)
    save_pretrained(build(ModelConfig(vocab_size=32000, kernels="reference", **cfg)), tmp_path)
    grown = _grown_whole_and_rows(VOCAB_PEAK, tmp_path)
    matrix = 32000 * 256
    assert grown["whole"] > matrix * 4, grown  # at least the fp32 matrix
    # the codes and scales (1.03 bytes a weight) and a few copies of one fp32 block: the fp32 matrix never
    # exists whole (12.9 MiB here, 17.5 MiB on another machine whose allocator keeps more; 31.25 MiB whole)
    assert grown["rows"] < 0.75 * matrix * 4, grown
    assert grown["rows"] < 0.4 * grown["whole"], grown


def test_the_untied_int8_head_read_in_row_blocks_equals_the_one_piece_head(tmp_path, monkeypatch) -> None:
    """An untied LM head in int8 (lm_head out of skip_modules) is read from its file a block of vocabulary
    rows at a time (here 3 rows a block: 43 blocks of its 128 rows), into the bytes that quantising the
    whole head gives, and the model computes the same logits."""
    from bmtrain_cli.quant import vocab
    from bmtrain_cli.quant.layer import Quantizer

    cfg = dict(TINY, tie_word_embeddings=False)
    save_pretrained(build(ModelConfig(vocab_size=128, kernels="reference", **cfg)), tmp_path)
    q = QuantizationConfig(method="int8", skip_modules=["norm", "gate"])
    blocks = []
    monkeypatch.setattr(vocab, "ROW_BLOCK_WEIGHTS", 3 * 64)
    read = vocab.quantize_rows
    monkeypatch.setattr(
        "bmtrain_cli.quant.layer.quantize_rows",
        lambda r, *a: read(lambda *rows: blocks.append(rows) or r(*rows), *a),
    )
    rows = load_pretrained(tmp_path, quantization=q, kernels="reference")
    assert isinstance(rows.lm_head, QuantLinear) and rows.lm_head.method == "int8"
    assert blocks[:2] == [(0, 3), (3, 6)] and blocks[-1] == (126, 128) and len(blocks) == 43  # the head's
    monkeypatch.setattr(Quantizer, "take_rows", lambda *args: False)  # every matrix read whole
    whole = load_pretrained(tmp_path, quantization=q, kernels="reference")
    np.testing.assert_array_equal(rows.lm_head.codes.numpy(), whole.lm_head.codes.numpy())
    np.testing.assert_array_equal(rows.lm_head.scales.numpy(), whole.lm_head.scales.numpy())
    assert rows.lm_head.nbytes == whole.lm_head.nbytes == 128 * 64 + 4 * 128
    ids = paddle.to_tensor([[1, 5, 9, 2, 7]])
    with paddle.no_grad():
        np.testing.assert_array_equal(rows(ids).numpy(), whole(ids).numpy())


HEAD_PEAK = PEAK.replace(
    'q = QuantizationConfig(method="nf4") if sys.argv[2] == "nf4" else None',
    "from bmtrain_cli.quant import layer, vocab\n"
    'q = QuantizationConfig(method="nf4", skip_modules=["norm", "gate"])\n'
    "vocab.ROW_BLOCK_WEIGHTS = 1 << 18\n"
    'if sys.argv[2] == "whole":  # the head read whole and quantised in one piece\n'
    "    layer.Quantizer._whole_head = lambda *args: False",
)


def test_the_untied_int8_head_is_quantised_as_it_is_read(tmp_path) -> None:
    """An untied 64000 x 256 head and embedding (62.5 MiB each in fp32, 15.6 MiB each in int8), both read a
    block of 256Ki weights at a time: the load grows the process by less than the fp32 head alone (their
    codes and one block's temporaries, with room for another allocator's arenas), where reading the head
    in one piece takes more than that."""
    cfg = dict(TINY, hidden_size=256, intermediate_size=256, num_hidden_layers=1, tie_word_embeddings=False)
    save_pretrained(build(ModelConfig(vocab_size=64000, kernels="reference", **cfg)), tmp_path)
    grown = _grown_whole_and_rows(HEAD_PEAK, tmp_path)
    matrix = 64000 * 256
    assert grown["whole"] > matrix * 4, grown  # at least the fp32 head
    assert grown["rows"] < matrix * 4, grown  # both matrices' codes: the fp32 head never exists whole
