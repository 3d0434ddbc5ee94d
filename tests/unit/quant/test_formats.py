"""The quantisation formats (bmtrain_cli/quant/formats.py) against bitsandbytes' own output and against
the formats' definitions, each checked in plain numpy here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from bmtrain_cli.quant import formats

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "quant" / "nf4_bnb.safetensors"
CASES = sorted({k.split(".")[0] for k in load_file(str(FIXTURE))})


@pytest.fixture(scope="module")
def bnb() -> dict:
    return load_file(str(FIXTURE))


@pytest.mark.parametrize("case", CASES)
def test_nf4_codes_and_absmax_equal_bitsandbytes(bnb: dict, case: str) -> None:
    block = int(bnb[f"{case}.block"][0])
    q = formats.quantize(bnb[f"{case}.weight"], "nf4", block)
    np.testing.assert_array_equal(q.codes, bnb[f"{case}.codes"])
    np.testing.assert_array_equal(q.scales, bnb[f"{case}.absmax"])


@pytest.mark.parametrize("case", CASES)
def test_nf4_double_quant_equals_bitsandbytes(bnb: dict, case: str) -> None:
    """The 8-bit blockwise codes and absmax are bitsandbytes' exactly for the same offset; the offset (a
    float32 mean, whose last bit depends on the summation order: ours is the correctly rounded mean)
    within 2 ulp of torch's."""
    block = int(bnb[f"{case}.block"][0])
    q = formats.quantize(bnb[f"{case}.weight"], "nf4", block, double_quant=True)
    assert q.scales is None
    np.testing.assert_array_equal(q.codes, bnb[f"{case}.codes"])
    theirs = np.float32(bnb[f"{case}.dq_offset"][0])
    assert abs(np.float32(q.scale_offset) - theirs) <= 2 * np.spacing(theirs)
    x = bnb[f"{case}.absmax"] - theirs
    codes, absmax = formats.quantize_blockwise8(x)
    np.testing.assert_array_equal(absmax, bnb[f"{case}.dq_absmax"])
    # bitsandbytes' CPU library searches the 256 levels approximately and now and then keeps the
    # neighbour of the nearest level (1 code in 320 here); ours is the nearest, and every code differs by
    # at most one level, where ours is the nearer
    levels, blocks = formats.dynamic_map(), np.arange(x.size) // formats.DOUBLE_QUANT_BLOCK
    scaled = x * (np.float32(1) / absmax[blocks])
    diff = np.flatnonzero(codes != bnb[f"{case}.dq_codes"])
    assert diff.size <= max(1, x.size // 100)
    for i in diff:
        theirs_code = int(bnb[f"{case}.dq_codes"][i])
        assert abs(int(codes[i]) - theirs_code) == 1
        assert abs(levels[codes[i]] - scaled[i]) < abs(levels[theirs_code] - scaled[i])


def _unpack(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.int64)
    out[0::2], out[1::2] = packed >> 4, packed & 15
    return out[:n]


def test_nf4_is_the_nearest_level_times_absmax() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 37)).astype(np.float32)
    q = formats.quantize(w, "nf4", 16)
    flat = w.reshape(-1)
    blocks = np.arange(flat.size) // 16
    absmax = np.array([np.abs(flat[blocks == b]).max() for b in range(blocks.max() + 1)], np.float32)
    np.testing.assert_array_equal(q.scales, absmax)
    deq = formats.NF4_LEVELS[_unpack(q.codes, flat.size)] * absmax[blocks]
    # no other level is nearer than the one picked
    dist = np.abs(formats.NF4_LEVELS[None, :] * absmax[blocks, None] - flat[:, None]).min(axis=1)
    np.testing.assert_allclose(np.abs(deq - flat), dist, atol=1e-6)


def test_dynamic_map_is_signed_sorted_and_spans_minus_one_to_one() -> None:
    m = formats.dynamic_map()
    assert m.shape == (256,) and np.all(np.diff(m) > 0)
    assert m[-1] == 1.0 and 0.0 in m and -0.995 < m[0] < -0.99
    assert np.count_nonzero(np.abs(m) < 1e-6) == 3  # zero and the smallest exponent's ±0.55e-6


def test_int8_is_per_channel_symmetric() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 11)).astype(np.float32)
    w[3] = 0.0
    q = formats.quantize(w, "int8")
    np.testing.assert_allclose(q.scales, np.abs(w).max(axis=1) / 127, rtol=1e-7)
    assert q.codes.dtype == np.int8 and np.abs(q.codes).max() == 127
    np.testing.assert_array_equal(q.codes[3], 0)
    err = np.abs(q.codes * q.scales[:, None] - w)
    assert np.all(err <= q.scales[:, None] / 2 + 1e-7)


def test_int4_is_per_group_symmetric_and_packed_row_major() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 13)).astype(np.float32)  # groups of 5: 5, 5, 3 per row; 39 codes
    q = formats.quantize(w, "int4", 5)
    assert q.scales.shape == (3, 3) and q.codes.shape == (20,)
    codes = _unpack(q.codes, 39).reshape(3, 13) - 8
    group = np.arange(13) // 5
    scale = q.scales[:, group]
    for r in range(3):
        for g in range(3):
            assert q.scales[r, g] == pytest.approx(np.abs(w[r, group == g]).max() / 7, rel=1e-6)
    assert codes.min() >= -7 and codes.max() <= 7
    assert np.all(np.abs(codes * scale - w) <= scale / 2 + 1e-6)
    assert (q.codes[-1] & 15) == 8  # the odd count is padded with a zero code


def test_nbytes_counts_codes_and_scales() -> None:
    w = np.ones((64, 128), np.float32)
    assert formats.quantize(w, "nf4", 64).nbytes == 64 * 128 // 2 + 128 * 4
    assert formats.quantize(w, "nf4", 64, double_quant=True).nbytes == 64 * 128 // 2 + 128 + 4 + 4
    assert formats.quantize(w, "int8").nbytes == 64 * 128 + 64 * 4


@pytest.mark.parametrize("shape", [(64, 128), (7, 70), (3, 129), (300, 700)])
@pytest.mark.parametrize(
    "method,dq,block", [("nf4", False, 64), ("nf4", True, 64), ("int8", False, 0), ("int4", False, 32)]
)
def test_quantized_nbytes_predicts_the_quantised_size(shape, method, dq, block) -> None:
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    got = formats.quantize(w, method, block, dq).nbytes
    assert formats.quantized_nbytes(method, shape[0], shape[1], block or shape[1], dq) == got


def _dequantized(q: formats.QuantizedWeight) -> np.ndarray:
    """The weight [out, in] ``q`` stands for, from the format's definition (module docstring)."""
    out_f, in_f = q.shape
    n = out_f * in_f
    if q.method == "int8":
        return q.codes.astype(np.float32) * q.scales[:, None]
    packed = q.codes.reshape(-1)
    codes = np.stack([packed >> 4, packed & 15], axis=1).reshape(-1)[:n]
    values = formats.levels(q.method)[codes].reshape(out_f, in_f)
    if q.method == "nf4":
        return (values.reshape(-1) * q.scales[np.arange(n) // q.block_size]).reshape(out_f, in_f)
    return values * q.scales[np.arange(out_f)[:, None], np.arange(in_f)[None, :] // q.block_size]


@pytest.mark.parametrize(
    "method, block, out_f, in_f, kind, exact",
    [
        ("nf4", 64, 96, 128, "column", True),  # 48 x 128 rows: whole blocks
        ("nf4", 64, 96, 128, "row", True),  # 64 inputs of each row: one block
        ("nf4", 64, 96, 96, "row", False),  # 48 inputs: blocks straddle the shards
        ("nf4", 64, 6, 40, "column", False),  # 3 x 40 = 120 elements: not whole blocks
        ("int4", 32, 10, 128, "row", True),
        ("int4", 32, 10, 80, "row", False),  # 40 inputs: a group straddles
        ("int4", 32, 10, 80, "column", True),  # groups run along whole rows
        ("int8", 0, 10, 80, "row", True),  # the scale comes from the whole row
    ],
)
def test_a_shard_quantised_alone_holds_the_whole_weights_codes_when_shard_mismatch_says_so(
    method: str, block: int, out_f: int, in_f: int, kind: str, exact: bool
) -> None:
    """Tensor parallel (parallel/layers.py): each of 2 ranks quantises its shard of w [out, in] (rows for
    a column-parallel layer, columns for a row-parallel one); ``shard_mismatch`` is '' exactly when the
    shards dequantise to the whole weight's dequantised values."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((out_f, in_f)).astype(np.float32) * rng.uniform(0.1, 3.0, (out_f, 1)).astype(
        np.float32
    )
    whole = _dequantized(formats.quantize(w, method, block or in_f))
    shards = np.split(w, 2, axis=0 if kind == "column" else 1)
    out_l, in_l = shards[0].shape
    assert (formats.shard_mismatch(method, block, kind, out_l, in_l) == "") is exact
    row_max = np.abs(w).max(axis=1) if method == "int8" else None  # the group's maximum (group_max)
    parts = [_dequantized(formats.quantize(s, method, block or in_l, row_absmax=row_max)) for s in shards]
    joined = np.concatenate(parts, axis=0 if kind == "column" else 1)
    assert np.array_equal(joined, whole) is exact
