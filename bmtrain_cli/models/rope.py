"""Position encodings: rotary embeddings (with the rope scaling types of LLaMA 3.x, Qwen, Mistral and Phi-3
checkpoints) and ALiBi slopes (Baichuan 13B).

The tables cover the rotated dimensions only (``rotary_dim``: all of a head, or the leading fraction that
GLM-4 and Phi-4-mini turn); models/decoder.py applies them to halves or, for ERNIE 4.5 and GLM-4, to
interleaved pairs.

Frequencies follow the Hugging Face formulas and are computed in fp32 like them, so logits match to
1e-4 or better on fp32 models.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import paddle

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_type(scaling: Optional[Dict[str, Any]]) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(
    head_dim: int, theta: float, scaling: Optional[Dict[str, Any]], max_position_embeddings: int
) -> Tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim/2] fp32, attention scaling of cos/sin) for a rope config.

    ``dynamic`` returns the unscaled frequencies; the per-call rescaling happens in
    :class:`RotaryTables` because it depends on the sequence length. ``longrope`` returns the short-factor
    frequencies (:func:`longrope_long_frequencies` has the others).
    """
    kind = rope_type(scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.float32(theta) ** exponents
    inv = (1.0 / pos_freqs).astype(np.float32)
    scaling = scaling or {}
    attention_factor = 1.0
    if kind == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        original = scaling.get("original_max_position_embeddings") or max_position_embeddings
        factor = float(scaling.get("factor") or max_position_embeddings / original)
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if scaling.get("attention_factor") is not None:
            attention_factor = float(scaling["attention_factor"])
        elif mscale and mscale_all:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention_factor = _yarn_mscale(factor)
        beta_fast = scaling.get("beta_fast") or 32
        beta_slow = scaling.get("beta_slow") or 1

        def corr_dim(rotations: float) -> float:
            return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
        extrapolation = 1 - ramp
        interp = 1.0 / (factor * pos_freqs)
        inv = (interp * (1 - extrapolation) + inv * extrapolation).astype(np.float32)
    elif kind == "longrope":
        inv = _longrope(pos_freqs, scaling["short_factor"])
        attention_factor = _longrope_attention_factor(scaling, max_position_embeddings)
    return inv.astype(np.float32), float(attention_factor)


def _longrope(pos_freqs: np.ndarray, factors: Any) -> np.ndarray:
    ext = np.asarray(factors, dtype=np.float32)
    if ext.shape != pos_freqs.shape:
        raise ValueError(
            f"longrope factors have {ext.size} entries, the rotary dimension needs {pos_freqs.size}"
        )
    return (1.0 / (ext * pos_freqs)).astype(np.float32)


def _longrope_attention_factor(scaling: Dict[str, Any], max_position_embeddings: int) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_long_frequencies(head_dim: int, theta: float, scaling: Dict[str, Any]) -> np.ndarray:
    """LongRoPE's frequencies past ``original_max_position_embeddings`` (the long factors)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return _longrope(np.float32(theta) ** exponents, scaling["long_factor"])


class RotaryTables:
    """cos/sin tables for given position ids. Holds the frequencies as a non-trainable buffer-like
    constant so that paddle.jit.to_static sees plain tensor maths."""

    def __init__(
        self, head_dim: int, theta: float, scaling: Optional[Dict[str, Any]], max_position_embeddings: int
    ):
        self.head_dim = head_dim
        self.theta = theta
        self.kind = rope_type(scaling)
        self.scaling = dict(scaling or {})
        self.max_position_embeddings = max_position_embeddings
        self.inv_freq, self.attention_factor = inv_frequencies(
            head_dim, theta, scaling, max_position_embeddings
        )
        self.long_inv_freq = (
            longrope_long_frequencies(head_dim, theta, self.scaling) if self.kind == "longrope" else None
        )

    @property
    def reads_longest(self) -> bool:
        """Whether the tables depend on the batch's largest position (dynamic NTK, longrope), which a
        context-parallel share does not hold: its caller passes the whole rows' as ``longest``."""
        return self.kind in ("dynamic", "longrope")

    def __call__(
        self, position_ids: paddle.Tensor, longest: Optional[paddle.Tensor] = None
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """position_ids [b, s] -> (cos, sin), each [b, s, head_dim] fp32 (head_dim: the rotated dimensions).
        ``longest``: the batch's largest position when ``position_ids`` are a share of it (default: theirs)."""
        pos = position_ids.astype("float32")
        seq_len = (pos.max() if longest is None else longest.astype("float32")) + 1.0
        if self.kind == "dynamic":
            inv = self._dynamic_inv_freq(seq_len)
        elif self.long_inv_freq is not None:  # longrope: the long factors once positions pass the original
            beyond = seq_len > float(self.scaling["original_max_position_embeddings"])
            inv = paddle.where(beyond, paddle.to_tensor(self.long_inv_freq), paddle.to_tensor(self.inv_freq))
        else:
            inv = paddle.to_tensor(self.inv_freq)
        freqs = pos.unsqueeze(-1) * inv.reshape([1, 1, -1])
        emb = paddle.concat([freqs, freqs], axis=-1)
        cos, sin = paddle.cos(emb), paddle.sin(emb)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _dynamic_inv_freq(self, seq_len: paddle.Tensor) -> paddle.Tensor:
        """Dynamic NTK: past the trained length, grow the base with the sequence length
        (seq_len = largest position + 1), as transformers does."""
        factor = float(self.scaling["factor"])
        original = float(self.scaling.get("original_max_position_embeddings") or self.max_position_embeddings)
        d = float(self.head_dim)
        grown = self.theta * ((factor * seq_len / original) - (factor - 1)) ** (d / (d - 2))
        base = paddle.where(seq_len > original, grown, paddle.full_like(seq_len, self.theta))
        exponents = paddle.to_tensor(np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(d))
        return 1.0 / paddle.pow(base, exponents)


def alibi_slopes(num_heads: int) -> List[float]:
    """ALiBi head slopes (Press et al.; the interleaving Baichuan 13B uses for non-powers of two)."""

    def power_of_2(n: int) -> List[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def latent_attention_mscale(scaling: Optional[Dict[str, Any]]) -> float:
    """What multi-head latent attention (DeepSeek-V3) multiplies its softmax scale by: YaRN's mscale at
    ``mscale_all_dim``, squared, as transformers folds it in (1 without scaling or mscale_all_dim)."""
    params = scaling or {}
    if rope_type(scaling) == "default" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
