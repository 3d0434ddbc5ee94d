"""The quantised linear layer: a frozen weight held as codes and scales (bmtrain_cli/quant/formats.py),
multiplied by bmtrain_cli/ops/quant_linear.py, and the swap of a model's linear layers for it.

``QuantLinear`` keeps its codes and scales as non-persistable buffers: they are not parameters (no
gradient, no optimizer state) and not in ``state_dict()`` (a LoRA run saves only its adapters; its base is
the checkpoint it was read from, re-quantised the same way on resume). An optional bias stays a frozen
parameter. ``dequantized_weight()`` gives the weight back in the Paddle layout [in, out] for the few
whole-weight paths (saving a fresh base).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.ops import quant_linear as qops
from bmtrain_cli.quant import formats
from bmtrain_cli.quant.select import HEAD_NAME, is_skipped
from bmtrain_cli.quant.vocab import QuantEmbedding, RowReader, VocabCodes, quantize_rows


def _buffer(array: np.ndarray) -> paddle.Tensor:
    t = paddle.to_tensor(np.ascontiguousarray(array))
    t.stop_gradient = True
    return t


class QuantLinear(nn.Layer):
    """y = x @ dequant(W)^T (+ bias) for a frozen quantised W [out, in]; see the module docstring."""

    def __init__(
        self, q: formats.QuantizedWeight, bias: Optional[paddle.Tensor], dtype: str, impl: str
    ) -> None:
        super().__init__()
        if impl not in qops.IMPLS:
            raise ValueError(f"QuantLinear: unknown implementation {impl!r} ({', '.join(qops.IMPLS)})")
        self.method, self.block_size, self.impl, self.compute_dtype = q.method, q.block_size, impl, dtype
        self.out_features, self.in_features = q.shape
        self.nbytes = q.nbytes
        self.register_buffer("codes", _buffer(q.codes.view(np.uint8).reshape(-1)), persistable=False)
        self.register_buffer("levels", _buffer(formats.levels(q.method)), persistable=False)
        if q.scales is not None:
            self.register_buffer("scales", _buffer(q.scales.reshape(-1)), persistable=False)
        else:  # double quant: the absmax as 8-bit codes, their per-256 absmax and the mean taken off
            assert q.scale_codes is not None and q.scale_absmax is not None
            self.register_buffer("scale_codes", _buffer(q.scale_codes), persistable=False)
            self.register_buffer("scale_levels", _buffer(formats.dynamic_map()), persistable=False)
            self.register_buffer("scale_absmax", _buffer(q.scale_absmax), persistable=False)
            self.scale_offset = float(q.scale_offset)
        self.bias = bias
        self._weight_only: Optional[Tuple[paddle.Tensor, paddle.Tensor, str, int]] = None

    @classmethod
    def from_int8_rows(
        cls,
        codes: paddle.Tensor,
        scales: paddle.Tensor,
        in_features: int,
        bias: Optional[paddle.Tensor],
        dtype: str,
        impl: str,
    ) -> QuantLinear:
        """An int8 layer from codes and per-row scales already quantised into tensors (quant/vocab.py's
        quantize_rows, which reads the untied LM head a block of rows at a time): the bytes
        :func:`formats.quantize` gives the whole weight, without a copy of them."""
        out_features = int(scales.shape[0])
        shape = (out_features, int(in_features))
        layer = cls(
            formats.QuantizedWeight("int8", shape, 0, np.zeros(0, np.int8), np.zeros(0, np.float32)),
            bias,
            dtype,
            impl,
        )
        layer.register_buffer("codes", codes, persistable=False)
        layer.register_buffer("scales", scales, persistable=False)
        layer.nbytes = int(codes.shape[0]) + 4 * out_features
        return layer

    def _scales(self) -> paddle.Tensor:
        if "scales" in self._buffers:
            return self.scales
        n = int(self.scale_codes.shape[0])
        absmax = qops.QuantWeight(
            self.scale_codes, self.scale_levels, self.scale_absmax, 8, formats.DOUBLE_QUANT_BLOCK, False, 1, n
        )
        return qops.dequantize(absmax).reshape([-1]) + self.scale_offset

    def quant_weight(self) -> qops.QuantWeight:
        """The weight as ops/quant_linear.py takes it (double-quantised scales restored first)."""
        bits = 8 if self.method == "int8" else 4
        row_groups = self.method != "nf4"
        block = self.in_features if self.method == "int8" else self.block_size
        return qops.QuantWeight(
            self.codes,
            self.levels,
            self._scales(),
            bits,
            block,
            row_groups,
            self.out_features,
            self.in_features,
        )

    def dequantized_weight(self) -> paddle.Tensor:
        """The weight [in, out] (Paddle's Linear layout) in the compute dtype."""
        dtype: Any = self.compute_dtype
        return qops.dequantize(self.quant_weight()).t().astype(dtype)

    def product(self, x: paddle.Tensor) -> paddle.Tensor:
        """x @ dequant(W)^T, without the bias."""
        if self.impl == "custom":
            return qops.custom_linear(x, self.quant_weight())
        if self.impl == "weight_only":
            if self._weight_only is None:
                self._weight_only = qops.to_weight_only(
                    self.quant_weight(), str(x.dtype).replace("paddle.", "")
                )
            return qops.weight_only_linear(x, self._weight_only)
        return qops.reference_linear(x, self.quant_weight())

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        y = self.product(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.method}, impl={self.impl}"


def _frozen_bias(layer: nn.Layer) -> Optional[paddle.Tensor]:
    """The layer's bias (None without), frozen: it stays beside the quantised weight."""
    bias = getattr(layer, "bias", None)
    if bias is not None:
        bias.stop_gradient = True
    return bias


class HeldElsewhere(nn.Layer):
    """A routed expert's projection that another expert-parallel rank holds: a quantised load reads and
    quantises only this rank's experts (:class:`Quantizer`), and this stands for the others, shape only,
    no codes and no parameters, so that every rank's model has the same parameters (LoRA wraps it like a
    QuantLinear) until parallel/expert_parallel.shard_experts drops it, before any forward."""

    def __init__(self, in_features: int, out_features: int, dtype: str) -> None:
        super().__init__()
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, dtype
        self.bias = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        raise RuntimeError("an expert another expert-parallel rank holds ran here (shard_experts not called)")


WEIGHTLESS = (QuantLinear, HeldElsewhere)  # frozen linear layers with no weight parameter


def quantize_linear(
    layer: nn.Layer, weight: np.ndarray, settings: Any, impl: str, factory: Any = None, name: str = ""
) -> nn.Layer:
    """A QuantLinear for ``layer`` (a linear layer ``factory`` made, nn.Linear by default) holding
    ``weight`` ([in, out], Paddle's layout; under tensor parallel this rank's shard, which the factory's
    ``quantized_linear`` wraps with the layer's collectives). A row-parallel int8 shard takes its
    per-channel scale from the whole row (the maximum over the group), so every rank's codes are the
    whole weight's. An embedding (``weight`` [vocab, hidden]) becomes an int8 QuantEmbedding, and the LM
    head (``name`` lm_head) is int8 whatever the method (quant/vocab.py reads it one vocabulary row at a time)."""
    if isinstance(layer, nn.Embedding):
        return QuantEmbedding(weight, str(layer.weight.dtype).replace("paddle.", ""))
    method, block, double = settings.method, settings.resolved_block_size, settings.double_quant
    if name.split(".")[-1] == HEAD_NAME:
        method, block, double = "int8", 0, False
    w = np.asarray(weight, np.float32).T
    row_absmax = None
    if factory is not None and method == "int8" and factory.linear_kind(layer) == "row":
        row_absmax = factory.group_max(np.abs(w).max(axis=1).astype(np.float32))
    q = formats.quantize(w, method, block or int(weight.shape[0]), double, row_absmax)
    bias = _frozen_bias(layer)
    dtype = str(layer.weight.dtype).replace("paddle.", "")
    if factory is None:
        return QuantLinear(q, bias, dtype, impl)
    return factory.quantized_linear(layer, q, bias, dtype, impl)


def quantizable(model: nn.Layer, settings: Any) -> Dict[str, Tuple[nn.Layer, str, nn.Layer]]:
    """{dotted name: (parent, attribute, layer)} of the layers ``settings`` quantises: nn.Linear, the
    split linear layers of the model's layer factory (``linear_kind``) when it has one, and the input
    embedding (int8, quant/vocab.py) when ``embed_tokens`` is not skipped."""
    factory = getattr(model, "factory", None)
    out: Dict[str, Tuple[nn.Layer, str, nn.Layer]] = {}
    for name, parent in model.named_sublayers(include_self=True):
        for attr, child in parent._sub_layers.items():
            full = f"{name}.{attr}" if name else attr
            linear = isinstance(child, (nn.Linear, nn.Embedding)) or (
                factory is not None and factory.linear_kind(child) is not None
            )
            if linear and not is_skipped(full, settings.skip_modules):
                out[full] = (parent, attr, child)
    return out


def impl_for(settings: Any, kernels: str) -> Callable[[int], str]:
    """in_features -> the implementation (ops/quant_linear.choose_impl) on this device."""
    device = paddle.get_device()
    bits = 8 if settings.method == "int8" else 4
    row_groups = settings.method != "nf4"
    return lambda in_f: qops.choose_impl(
        kernels, device, bits, row_groups, settings.resolved_block_size or in_f, in_f
    )


def quantize_model(model: nn.Layer, settings: Any, kernels: str = "auto") -> List[str]:
    """Swap the model's quantisable linear layers (built and holding their weights) for QuantLinear ones,
    one at a time, each fp32 weight released as soon as its codes exist; returns their names."""
    impl = impl_for(settings, kernels)
    factory = getattr(model, "factory", None)
    names = []
    for full, (parent, attr, layer) in quantizable(model, settings).items():
        weight = layer.weight.numpy()
        quantised = quantize_linear(layer, weight, settings, impl(int(weight.shape[0])), factory, full)
        setattr(parent, attr, quantised)
        names.append(full)
    return names


class Quantizer:
    """Quantises a model's linear layers as their weights arrive from a checkpoint (the ``take`` of
    models/hf.py's load_hf_state_dict): the model was built under paddle.LazyGuard, so those layers'
    full-precision weights are never allocated; each is read, quantised and dropped."""

    def __init__(
        self,
        model: nn.Layer,
        settings: Any,
        kernels: str = "auto",
        held_experts: Optional[Callable[[int], Sequence[int]]] = None,
    ) -> None:
        self.settings = settings
        self.factory = getattr(model, "factory", None)
        self.impl = impl_for(settings, kernels)
        self.targets = {f"{name}.weight": place for name, place in quantizable(model, settings).items()}
        self.elsewhere = _elsewhere(model, held_experts, self.targets) if held_experts is not None else set()

    def _skip(self, name: str) -> bool:
        """An expert another rank holds: never read, a :class:`HeldElsewhere` in its place."""
        parent, attr, layer = self.targets.pop(name)
        k, n = (int(d) for d in layer.weight.shape)
        setattr(parent, attr, HeldElsewhere(k, n, str(layer.weight.dtype).replace("paddle.", "")))
        return True

    def take(self, name: str, weight: np.ndarray) -> bool:
        """Quantise ``weight`` ([in, out]) into its layer when ``name`` is a quantised layer's weight."""
        if name in self.elsewhere:
            return self._skip(name)
        place = self.targets.pop(name, None)
        if place is None:
            return False
        parent, attr, layer = place
        impl = self.impl(int(weight.shape[0]))
        setattr(
            parent,
            attr,
            quantize_linear(layer, weight, self.settings, impl, self.factory, name[: -len(".weight")]),
        )
        return True

    def take_rows(self, name: str, source: Optional[Tuple[RowReader, Tuple[int, ...]]]) -> bool:
        """Quantise a vocabulary matrix in int8 a block of rows at a time as ``source`` (read(r0, r1), shape)
        reads it from its file (quant/vocab.py): a quantised embedding's weight of the file's shape, or an
        untied LM head's (the file's [vocab, hidden]: its output channels are the rows). An expert another
        expert-parallel rank holds is taken unread."""
        if name in self.elsewhere:
            return self._skip(name)
        place = self.targets.get(name)
        if source is None or place is None:
            return False
        (read, shape), (parent, attr, layer) = source, place
        dtype = str(layer.weight.dtype).replace("paddle.", "")
        taken: Optional[nn.Layer] = None
        if len(shape) != 2:
            return False
        vocab, hidden = int(shape[0]), int(shape[1])
        if isinstance(layer, nn.Embedding) and list(shape) == list(layer.weight.shape):
            taken = QuantEmbedding((read, vocab, hidden), dtype)
        elif self._whole_head(name, layer) and list(shape) == list(layer.weight.shape)[::-1]:
            codes, scales = quantize_rows(read, vocab, hidden)
            taken = QuantLinear.from_int8_rows(
                codes, scales, hidden, _frozen_bias(layer), dtype, self.impl(hidden)
            )
        if taken is None:
            return False
        del self.targets[name]
        setattr(parent, attr, taken)
        return True

    def _whole_head(self, name: str, layer: nn.Layer) -> bool:
        """Whether ``name`` is the weight of an LM head held whole (an nn.Linear, not a tensor-parallel shard)."""
        kind = "whole" if self.factory is None else self.factory.linear_kind(layer)
        head = name.rsplit(".", 1)[0].split(".")[-1] == HEAD_NAME
        return head and isinstance(layer, nn.Linear) and kind == "whole"


def _elsewhere(
    model: nn.Layer, held_experts: Callable[[int], Sequence[int]], targets: Dict[str, Any]
) -> Set[str]:
    """The quantised weights of the routed experts ``held_experts(num_experts)`` leaves to other ranks, in
    every MoE layer (a layer with ``shard_experts``, models/moe.py)."""
    out: Set[str] = set()
    for name, layer in model.named_sublayers():
        if getattr(layer, "shard_experts", None) is None:
            continue
        mine = set(held_experts(layer.num_experts))
        stems = tuple(f"{name}.experts.{e}." for e in range(layer.num_experts) if e not in mine)
        out |= {t for t in targets if t.startswith(stems)}
    return out


def quantized_layers(model: nn.Layer) -> List[Tuple[str, Any]]:
    """(name, layer) of every QuantLinear, also those a LoRA wrapper holds as its ``base_layer``, and a
    QuantEmbedding."""
    out = []
    kinds = (QuantLinear, QuantEmbedding)
    for name, m in model.named_sublayers():
        layer = m if isinstance(m, kinds) else getattr(m, "base_layer", None)
        if isinstance(layer, kinds):
            out.append((name, layer))
    return out


def quantized_bytes(model: nn.Layer) -> int:
    """Bytes of every quantised layer's codes and scales."""
    return sum(m.nbytes for _, m in quantized_layers(model))


def quantized_head(lm_head: Optional[nn.Layer], embed_tokens: nn.Layer) -> Optional[VocabCodes]:
    """The int8 LM head as vocabulary rows: the head's own (an int8 QuantLinear, whose output channels are
    the vocabulary), or the tied embedding's codes (``lm_head`` None); None when the head is not quantised."""
    if lm_head is None:
        return embed_tokens.vocab_codes() if isinstance(embed_tokens, QuantEmbedding) else None
    if isinstance(lm_head, QuantLinear) and lm_head.method == "int8":
        return VocabCodes(lm_head.codes, lm_head.scales, lm_head.in_features)
    return None


IMPL_NAMES = {
    "custom": "our CPU kernels",
    "reference": "dequantise-then-matmul",
    "weight_only": "Paddle's weight_only_linear",
}


def summary(model: nn.Layer) -> str:
    """'' without quantised layers, else one line: how many, which format and kernels, how many bytes."""
    every = [m for _, m in quantized_layers(model)]
    if not every:
        return ""
    layers = [m for m in every if isinstance(m, QuantLinear)]
    methods = sorted({m.method for m in layers})
    impls = sorted({IMPL_NAMES[m.impl] for m in layers})
    mib = quantized_bytes(model) / 2**20
    embedding = ", the embedding in int8" if len(every) > len(layers) else ""
    return (
        f"quantised base: {len(layers)} linear layers in {'/'.join(methods)} ({', '.join(impls)}){embedding}, "
        f"{mib:.2f} MiB of codes and scales"
    )
