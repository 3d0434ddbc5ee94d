"""Weight-only quantisation formats, in numpy (the weights are quantised once, while loaded or built).

Every format quantises a linear weight in Hugging Face's layout, ``w [out, in]``, read row-major.

* ``nf4``: 4-bit NormalFloat (Dettmers et al., QLoRA, 2023). The flattened weight is cut into blocks of
  ``block_size`` elements (the last one may be shorter); each block is divided by its absolute maximum
  (``absmax``, fp32) and each value replaced by the index of the nearest of the 16 NF4 levels (a value on a
  midpoint goes to the lower level). Two codes per byte, the first element in the high nibble: the layout
  of bitsandbytes' ``quantize_4bit(quant_type="nf4")`` (an odd count is padded with a zero value).
  ``double_quant`` stores the absmax 8-bit too: their mean is subtracted, then they are quantised
  blockwise (blocks of 256) against the signed 8-bit dynamic map (Dettmers et al., 8-bit optimizers,
  2022), as bitsandbytes' ``compress_statistics=True``.
* ``int8``: symmetric per output channel: ``scale[o] = max|w[o, :]| / 127``, codes ``round(w / scale)``.
* ``int4``: symmetric per group of ``block_size`` consecutive inputs of one row (the last group of a row
  may be shorter): ``scale = max|w| / 7``, codes ``round(w / scale)`` in [-7, 7] stored as ``code + 8``,
  two per byte in the nf4 order.

The dequantised weight is ``level(code) * scale``; bmtrain_cli/ops/quant_linear.py computes it (and the
layer's product) in Paddle and in the C++ kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

import numpy as np

# The 16 NF4 levels: quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (QLoRA, appendix E)
NF4_LEVELS = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
DOUBLE_QUANT_BLOCK = 256
INT4_MAX = 7
INT8_MAX = 127
TINY = np.float32(1e-38)  # an all-zero block divides by this instead of 0 (its codes are then level 0.0)


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantised weight [out, in]. ``scales``: nf4's absmax per block (None when double-quantised),
    int4's per group, int8's per output channel. The double-quant fields hold nf4's absmax as 8-bit codes,
    their per-256 absmax and the mean that was subtracted."""

    method: str
    shape: Tuple[int, int]
    block_size: int
    codes: np.ndarray
    scales: Optional[np.ndarray]
    scale_codes: Optional[np.ndarray] = None
    scale_absmax: Optional[np.ndarray] = None
    scale_offset: float = 0.0

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and everything needed to dequantise them."""
        parts = (self.codes, self.scales, self.scale_codes, self.scale_absmax)
        return sum(int(p.nbytes) for p in parts if p is not None) + (4 if self.scale_codes is not None else 0)


def quantized_nbytes(
    method: str, out_f: int, in_f: int, block_size: int = 64, double_quant: bool = False
) -> int:
    """Bytes of a quantised [out_f, in_f] weight (codes and scales), without quantising it (bmtrain plan)."""
    n = out_f * in_f
    if method == "int8":
        return n + 4 * out_f
    if method == "int4":
        return -(-n // 2) + 4 * out_f * -(-in_f // block_size)
    blocks = -(-n // block_size)
    scales = blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + 4 if double_quant else 4 * blocks
    return -(-n // 2) + scales


def _nearest(scaled: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Index of the nearest of the sorted ``levels`` (on a midpoint: the lower one)."""
    bounds = ((levels[:-1] + levels[1:]) / np.float32(2)).astype(np.float32)
    return np.searchsorted(bounds, scaled, side="left").astype(np.uint8)


def _blockwise_scaled(flat: np.ndarray, block: int) -> Tuple[np.ndarray, np.ndarray]:
    """(values divided by their block's absmax and clipped to [-1, 1], absmax per block), fp32."""
    n = flat.size
    blocks = -(-n // block)
    padded = np.zeros(blocks * block, dtype=np.float32)
    padded[:n] = flat
    absmax = np.abs(padded.reshape(blocks, block)).max(axis=1).astype(np.float32)
    inv = (np.float32(1) / np.maximum(absmax, TINY)).astype(np.float32)
    scaled = np.clip(padded.reshape(blocks, block) * inv[:, None], -1, 1).reshape(-1)[:n]
    return scaled.astype(np.float32), absmax


def pack_nibbles(codes: np.ndarray, pad: int) -> np.ndarray:
    """Two 4-bit codes per byte, the first in the high nibble; an odd count is padded with ``pad``."""
    flat = codes.reshape(-1).astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.array([pad], dtype=np.uint8)])
    return ((flat[0::2] << 4) | flat[1::2]).astype(np.uint8)


@lru_cache(maxsize=1)
def dynamic_map() -> np.ndarray:
    """The signed 8-bit dynamic (tree) quantisation map, 256 sorted levels in [-1, 1]: for each decimal
    exponent e = 10^(i-6), i = 0..6, the midpoints of 2^i + 1 evenly spaced points on [0.1, 1] times ±e;
    then 0 and 1 (8-bit optimizers, section 2)."""
    levels = [0.0, 1.0]
    for i in range(7):
        points = np.linspace(0.1, 1.0, 2**i + 1)
        mids = (points[:-1] + points[1:]) / 2.0
        levels += list(10.0 ** (i - 6) * mids) + list(-(10.0 ** (i - 6)) * mids)
    out = np.sort(np.array(levels, dtype=np.float32))
    assert out.size == 256
    return out


def quantize_nf4(w: np.ndarray, block_size: int = 64) -> Tuple[np.ndarray, np.ndarray]:
    """(packed codes uint8 [ceil(n / 2)], absmax fp32 [ceil(n / block_size)]) of ``w`` read row-major."""
    scaled, absmax = _blockwise_scaled(np.asarray(w, dtype=np.float32).reshape(-1), block_size)
    zero = int(np.flatnonzero(NF4_LEVELS == 0)[0])
    return pack_nibbles(_nearest(scaled, NF4_LEVELS), pad=zero), absmax


def quantize_blockwise8(x: np.ndarray, block: int = DOUBLE_QUANT_BLOCK) -> Tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [n], absmax fp32 [ceil(n / block)]): ``x`` against :func:`dynamic_map`, blockwise."""
    scaled, absmax = _blockwise_scaled(np.asarray(x, dtype=np.float32).reshape(-1), block)
    return _nearest(scaled, dynamic_map()), absmax


def quantize_int8(w: np.ndarray, row_absmax: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(codes int8 [out, in], scale fp32 [out]). ``row_absmax``: each row's absolute maximum when ``w``
    holds only some of the row's columns (a row-parallel shard; default: ``w``'s own)."""
    w = np.asarray(w, dtype=np.float32)
    absmax = np.abs(w).max(axis=1) if row_absmax is None else np.asarray(row_absmax, np.float32)
    scale = (absmax / np.float32(INT8_MAX)).astype(np.float32)
    q = np.rint(w / np.maximum(scale, TINY)[:, None])
    return np.clip(q, -INT8_MAX, INT8_MAX).astype(np.int8), scale


def quantize_int4(w: np.ndarray, group: int = 64) -> Tuple[np.ndarray, np.ndarray]:
    """(packed codes uint8 [ceil(out * in / 2)], scale fp32 [out, ceil(in / group)])."""
    w = np.asarray(w, dtype=np.float32)
    out_f, in_f = w.shape
    groups = -(-in_f // group)
    padded = np.zeros((out_f, groups * group), dtype=np.float32)
    padded[:, :in_f] = w
    grouped = padded.reshape(out_f, groups, group)
    scale = (np.abs(grouped).max(axis=2) / np.float32(INT4_MAX)).astype(np.float32)
    q = np.clip(np.rint(grouped / np.maximum(scale, TINY)[:, :, None]), -INT4_MAX, INT4_MAX)
    codes = (q.reshape(out_f, groups * group)[:, :in_f] + INT4_MAX + 1).astype(np.uint8)
    return pack_nibbles(codes, pad=INT4_MAX + 1), scale


def levels(method: str) -> np.ndarray:
    """The value of each code (fp32 [16] at 4 bits, [256] at 8): nf4's levels; int4's ``code - 8``;
    int8's code bytes read as signed."""
    if method == "nf4":
        return NF4_LEVELS
    if method == "int4":
        return np.arange(16, dtype=np.float32) - np.float32(INT4_MAX + 1)
    return np.arange(256, dtype=np.uint8).view(np.int8).astype(np.float32)


def quantize(
    w: np.ndarray,
    method: str,
    block_size: int = 64,
    double_quant: bool = False,
    row_absmax: Optional[np.ndarray] = None,
) -> QuantizedWeight:
    """``w [out, in]`` in ``method`` (nf4, int8, int4); see the module docstring. ``row_absmax``: int8's
    whole-row maxima for a shard of the columns (:func:`quantize_int8`)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize: a linear weight [out, in] is 2-D, got shape {list(w.shape)}")
    shape = (int(w.shape[0]), int(w.shape[1]))
    if method == "int8":
        codes, scale = quantize_int8(w, row_absmax)
        return QuantizedWeight("int8", shape, 0, codes, scale)
    if method == "int4":
        codes, scale = quantize_int4(w, block_size)
        return QuantizedWeight("int4", shape, block_size, codes, scale)
    if method != "nf4":
        raise ValueError(f"quantize: unknown method {method!r} (nf4, int8, int4)")
    codes, absmax = quantize_nf4(w, block_size)
    if not double_quant:
        return QuantizedWeight("nf4", shape, block_size, codes, absmax)
    offset = float(np.float32(absmax.mean(dtype=np.float64)))  # the correctly rounded fp32 mean
    scale_codes, scale_absmax = quantize_blockwise8(absmax - np.float32(offset))
    return QuantizedWeight("nf4", shape, block_size, codes, None, scale_codes, scale_absmax, offset)


def shard_mismatch(method: str, block_size: int, kind: str, out_local: int, in_local: int) -> str:
    """'' when a tensor-parallel rank that quantises its own shard (``out_local`` x ``in_local`` of a
    column- or row-parallel weight [out, in]) gets exactly the codes and scales the whole weight has for
    those elements, else why not. nf4's blocks run over the row-major flattening, so a column shard (rows
    of w) must start on a block boundary and a row shard's pieces of each row must hold whole blocks;
    int4's groups run along each row; int8's per-channel scale is taken over the whole row (the
    group's maximum, see :func:`quantize_int8`), so it always matches."""
    if method == "int8" or (method == "int4" and kind == "column"):
        return ""
    if kind == "column" and method == "nf4" and (out_local * in_local) % block_size:
        return (
            f"a column shard of {out_local} x {in_local} = {out_local * in_local} elements is not a whole "
            f"number of nf4 blocks of {block_size}"
        )
    if kind == "row" and in_local % block_size:
        what = "nf4 block" if method == "nf4" else "int4 group"
        return f"a row shard's {in_local} input features are not a whole number of {what}s of {block_size}"
    return ""
