"""Weight-only INT8 quantisation with per-output-channel symmetric scales.

For a weight ``W`` the scale of output channel ``j`` is ``s_j = max_i |W[i, j]| / 127`` and the stored
weight is ``q = round(W / s)`` clipped to [-127, 127] (int8). The quantised model computes with the
dequantised weight ``q * s`` exactly: on a GPU through Paddle's ``weight_only_linear`` (fp16/bf16 inputs)
and everywhere else with an explicit cast-and-multiply in the graph, since Paddle has no CPU kernel for
``weight_only_linear``. The int8 tensor and the scales are ordinary buffers, so they survive
``paddle.jit.save`` (paddle-inference export) and ``state_dict()`` (hf export) as int8 + fp32.

Quantised: every ``paddle.nn.Linear`` (attention q/k/v/o, MLP gate/up/down, the LM head) and, unless
``embeddings=False``, every ``paddle.nn.Embedding`` (per-row scales: the output channel of a tied LM head).
Not quantised: norms and biases (tiny, kept fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import paddle

from bmtrain_cli.machine import gpu_available

QMAX = 127
SCALE_SUFFIX = "weight_scale"
QUANT_METHOD = "bmtrain_weight_only_int8"

# GPU architectures Paddle's weight_only_linear kernel supports.
_KERNEL_ARCHS = (70, 75, 80, 86, 89, 90, 92, 100)


def quantize_array(w: np.ndarray, axis: int) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantisation of ``w`` with one scale per index along ``axis`` (the output channel).

    Returns (int8 array of w's shape, float32 scales of shape [w.shape[axis]]). A channel of zeros gets
    scale 1 (any scale represents it exactly). The element of largest magnitude of each channel maps to
    exactly +-127, so the channel maximum of ``|q|`` is 127.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {w.shape}")
    reduce_axis = 1 - axis
    amax = np.abs(w).max(axis=reduce_axis)
    scale = np.where(amax > 0, amax / QMAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.expand_dims(scale, reduce_axis)), -QMAX, QMAX).astype(np.int8)
    return q, scale


def dequantize_array(q: np.ndarray, scale: np.ndarray, axis: int) -> np.ndarray:
    """float32 weight represented by (q, scale); the exact inverse of the stored format."""
    return q.astype(np.float32) * np.expand_dims(np.asarray(scale, np.float32), 1 - axis)


def _gpu_arch() -> Optional[int]:
    """Compute capability as an int (80 for A100, 90 for H100/H200), None without a usable GPU."""
    if not gpu_available():
        return None
    major, minor = paddle.device.cuda.get_device_capability()
    arch = major * 10 + minor
    return arch if arch in _KERNEL_ARCHS else None


class QuantLinear(paddle.nn.Layer):
    """y = x @ (q * s) + b with q: int8 [in, out] (Paddle Linear layout), s: fp32 [out].

    ``use_kernel``: "auto" uses ``paddle.nn.quant.weight_only_linear`` when the layer lives on a
    supported GPU and the input is fp16/bf16; "never" always dequantises (what the exported graph does,
    so an export runs on any device); "always" requires the kernel.
    """

    def __init__(self, in_features: int, out_features: int, has_bias: bool, use_kernel: str = "auto"):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.use_kernel = use_kernel
        self.register_buffer("qweight", paddle.zeros([in_features, out_features], dtype="int8"))
        self.register_buffer(SCALE_SUFFIX, paddle.ones([out_features], dtype="float32"))
        self.bias = self.create_parameter([out_features], is_bias=True, dtype="float32") if has_bias else None
        self._kernel: Optional[Tuple[paddle.Tensor, paddle.Tensor, int]] = None

    @classmethod
    def from_linear(cls, linear: paddle.nn.Linear, use_kernel: str = "auto") -> QuantLinear:
        w = linear.weight.numpy()
        layer = cls(w.shape[0], w.shape[1], linear.bias is not None, use_kernel)
        layer.set_quantized(*quantize_array(w, axis=1))
        if layer.bias is not None:  # made with one where linear has one
            layer.bias.set_value(linear.bias.astype("float32"))
        return layer

    def set_quantized(self, q: np.ndarray, scale: np.ndarray) -> None:
        """Load an int8 [in, out] weight and its fp32 [out] scales."""
        if tuple(q.shape) != (self.in_features, self.out_features) or q.dtype != np.int8:
            raise ValueError(
                f"expected int8 {[self.in_features, self.out_features]}, got {q.dtype} {q.shape}"
            )
        self.qweight.set_value(paddle.to_tensor(q, dtype="int8"))
        getattr(self, SCALE_SUFFIX).set_value(paddle.to_tensor(np.asarray(scale, np.float32)))
        self._kernel = None

    @property
    def weight(self) -> paddle.Tensor:
        """The dequantised weight [in, out] (float32), computed in the graph."""
        return self.qweight.astype("float32") * getattr(self, SCALE_SUFFIX).unsqueeze(0)

    def _kernel_weights(self) -> Tuple[paddle.Tensor, paddle.Tensor, int]:
        """The weight in the kernel's own (architecture-specific) layout, built once.

        weight_quantize of the int8 values themselves (exact in fp16: |q| <= 127) finds a channel maximum
        of 127, hence a kernel scale of exactly 1 and the same integers, rearranged for the kernel; the
        product of the two scales is the real one.
        """
        if self._kernel is None:
            from paddle.nn.quant import weight_quantize

            arch = _gpu_arch()
            assert arch is not None
            kq, kscale = weight_quantize(self.qweight.astype("float16"), algo="weight_only_int8", arch=arch)
            self._kernel = (kq, kscale.astype("float32") * getattr(self, SCALE_SUFFIX), arch)
        return self._kernel

    def _kernel_usable(self, x: paddle.Tensor) -> bool:
        if self.use_kernel == "never" or paddle.in_dynamic_mode() is False:
            return False
        ok = (
            x.dtype in (paddle.float16, paddle.bfloat16)
            and x.place.is_gpu_place()
            and _gpu_arch() is not None
        )
        if self.use_kernel == "always" and not ok:
            raise RuntimeError(
                "weight_only_linear needs a supported GPU (sm70-sm100) and fp16/bf16 inputs; "
                f"got {x.dtype} on {x.place}"
            )
        return ok

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self._kernel_usable(x):
            from paddle.nn.quant import weight_only_linear

            kq, kscale, arch = self._kernel_weights()
            bias = None if self.bias is None else self.bias.astype(x.dtype)
            return weight_only_linear(
                x, kq, bias=bias, weight_scale=kscale.astype(x.dtype), weight_dtype="int8", arch=arch
            )
        w = self.weight
        if x.dtype != w.dtype:
            w = w.astype(x.dtype)
        y = paddle.matmul(x, w)
        if self.bias is not None:
            y = y + self.bias.astype(y.dtype)
        return y


class QuantEmbedding(paddle.nn.Layer):
    """Embedding lookup of int8 rows [vocab, hidden] with one fp32 scale per row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer("qweight", paddle.zeros([num_embeddings, embedding_dim], dtype="int8"))
        self.register_buffer(SCALE_SUFFIX, paddle.ones([num_embeddings], dtype="float32"))

    @classmethod
    def from_embedding(cls, emb: paddle.nn.Embedding) -> QuantEmbedding:
        w = emb.weight.numpy()
        layer = cls(w.shape[0], w.shape[1], getattr(emb, "_padding_idx", None))
        layer.set_quantized(*quantize_array(w, axis=0))
        return layer

    def set_quantized(self, q: np.ndarray, scale: np.ndarray) -> None:
        if tuple(q.shape) != (self.num_embeddings, self.embedding_dim) or q.dtype != np.int8:
            raise ValueError(
                f"expected int8 {[self.num_embeddings, self.embedding_dim]}, got {q.dtype} {q.shape}"
            )
        self.qweight.set_value(paddle.to_tensor(q, dtype="int8"))
        getattr(self, SCALE_SUFFIX).set_value(paddle.to_tensor(np.asarray(scale, np.float32)))

    @property
    def weight(self) -> paddle.Tensor:
        """The dequantised table [vocab, hidden] (used by a tied LM head)."""
        return self.qweight.astype("float32") * getattr(self, SCALE_SUFFIX).unsqueeze(1)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        rows = paddle.nn.functional.embedding(ids, self.qweight.astype("float32"))
        return rows * paddle.nn.functional.embedding(ids, getattr(self, SCALE_SUFFIX).unsqueeze(1))


@dataclass
class QuantReport:
    """What quantize_model changed, and the bytes of the weights before and after."""

    linear: List[str] = field(default_factory=list)
    embedding: List[str] = field(default_factory=list)
    fp32_bytes: int = 0
    quantized_bytes: int = 0

    @property
    def modules(self) -> List[str]:
        return self.linear + self.embedding

    @property
    def ratio(self) -> float:
        return self.quantized_bytes / self.fp32_bytes if self.fp32_bytes else float("nan")

    def to_dict(self) -> Dict[str, object]:
        return {
            "quantized_linear": self.linear,
            "quantized_embedding": self.embedding,
            "fp32_bytes": self.fp32_bytes,
            "quantized_bytes": self.quantized_bytes,
            "ratio": self.ratio,
        }


def _tensor_bytes(layer: paddle.nn.Layer) -> int:
    return sum(int(np.prod(t.shape)) * t.element_size() for t in layer.state_dict().values())


def _quantizable(
    model: paddle.nn.Layer, embeddings: bool
) -> List[Tuple[str, Union[paddle.nn.Linear, paddle.nn.Embedding]]]:
    found: List[Tuple[str, Union[paddle.nn.Linear, paddle.nn.Embedding]]] = []
    for name, layer in model.named_sublayers():
        if type(layer) is paddle.nn.Linear or (embeddings and type(layer) is paddle.nn.Embedding):
            found.append((name, layer))
    return found


def _replace(model: paddle.nn.Layer, name: str, new: paddle.nn.Layer) -> None:
    parent = model
    *path, last = name.split(".")
    for part in path:
        parent = getattr(parent, part)
    setattr(parent, last, new)


def quantize_model(
    model: paddle.nn.Layer, embeddings: bool = True, use_kernel: str = "auto", skip: Tuple[str, ...] = ()
) -> QuantReport:
    """Replace (in place) every Linear, and with ``embeddings`` every Embedding, by its int8 version.

    ``skip`` holds sublayer names to leave in fp32. Returns which layers were quantised and the weight
    bytes of the whole model before (all fp32) and after.
    """
    report = QuantReport()
    report.fp32_bytes = sum(int(np.prod(p.shape)) * 4 for p in model.state_dict().values())
    for name, layer in _quantizable(model, embeddings):
        if name in skip:
            continue
        if isinstance(layer, paddle.nn.Linear):
            _replace(model, name, QuantLinear.from_linear(layer, use_kernel))
            report.linear.append(name)
        else:
            _replace(model, name, QuantEmbedding.from_embedding(layer))
            report.embedding.append(name)
    report.quantized_bytes = _tensor_bytes(model)
    return report


def make_quantized_skeleton(
    model: paddle.nn.Layer, linear: List[str], embedding: List[str], use_kernel: str = "auto"
) -> None:
    """Swap the named layers of a freshly built fp32 model for empty quantised ones (for loading)."""
    for name in linear:
        layer = model
        for part in name.split("."):
            layer = getattr(layer, part)
        w = layer.weight
        _replace(model, name, QuantLinear(w.shape[0], w.shape[1], layer.bias is not None, use_kernel))
    for name in embedding:
        layer = model
        for part in name.split("."):
            layer = getattr(layer, part)
        w = layer.weight
        _replace(model, name, QuantEmbedding(w.shape[0], w.shape[1], getattr(layer, "_padding_idx", None)))
