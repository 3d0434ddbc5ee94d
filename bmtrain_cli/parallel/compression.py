"""Gradient compression for the data-parallel all-reduce.

* ``int8``: the flattened gradient is cut into chunks of ``CHUNK`` values; each chunk is sent as int8
  with one fp32 scale (max |x| / 127). About 4x fewer bytes than fp32.
* ``topk``: only the ``topk_ratio`` largest-magnitude entries are sent (int32 index + fp32 value); what
  is not sent stays in a per-rank residual added to the next step's gradient (error feedback), so every
  gradient component is applied eventually.
* ``threshold``: only the entries whose magnitude (gradient + residual) reaches ``compression_threshold``
  are sent (int32 index + fp32 value), the rest stays in the residual (error feedback). How many are
  sent varies per rank and step; the ranks agree on the largest count and pad to it (gloo's all-gather
  needs equal sizes), and the padded bytes are what is counted.

Each rank all-gathers the compressed payloads (gloo has no reduce-scatter) and sums the decoded
contributions in rank order, so all ranks apply the identical gradient and stay in sync. Bytes are
counted per rank per step: payload bytes this rank contributes versus the fp32 bytes of the dense
gradient.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

CHUNK = 256


class Compressor:
    name = "none"

    def __init__(self) -> None:
        self.steps = 0
        self.bytes_sent = 0
        self.bytes_dense = 0

    # encode/decode work on a flat fp32 tensor; subclasses implement them
    def encode(self, flat: Any) -> List[Any]:
        raise NotImplementedError

    def decode(self, payload: Sequence[Any], numel: int) -> Any:
        raise NotImplementedError

    @staticmethod
    def payload_bytes(payload: Sequence[Any]) -> int:
        total = 0
        for t in payload:
            size = 1
            for d in t.shape:
                size *= int(d)
            total += size * _itemsize(t)
        return total

    def all_reduce_sum(self, params: Sequence[Any], group: Any) -> None:
        """Replace each parameter's gradient by the sum over the group of the decoded gradients."""
        import paddle
        import paddle.distributed as dist

        grads = [p.grad for p in params]
        flat = paddle.concat([g.astype("float32").reshape([-1]) for g in grads])
        numel = int(flat.shape[0])
        payload = self.equalise(self.encode(flat), group)
        self.bytes_sent += self.payload_bytes(payload)
        self.bytes_dense += numel * 4
        self.steps += 1
        gathered: List[List[Any]] = []
        for part in payload:
            parts: List[Any] = []
            dist.all_gather(parts, part, group=group)
            gathered.append(parts)
        total = self.decode([g[0] for g in gathered], numel)
        for r in range(1, len(gathered[0])):
            total = total + self.decode([g[r] for g in gathered], numel)
        offset = 0
        for g in grads:
            n = int(math.prod(g.shape))
            g.set_value(total[offset : offset + n].reshape(g.shape).astype(g.dtype))
            offset += n

    def equalise(self, payload: List[Any], group: Any) -> List[Any]:
        """The payload made the same size on every rank of ``group`` (fixed-size encodings already are)."""
        return payload

    def stats(self) -> Dict[str, Any]:  # the name, counts and the ratio
        ratio = self.bytes_dense / self.bytes_sent if self.bytes_sent else 0.0
        return {
            "compression": self.name,
            "steps": self.steps,
            "bytes_sent": self.bytes_sent,
            "bytes_dense": self.bytes_dense,
            "ratio": ratio,
        }


def _itemsize(t: Any) -> int:
    name = str(t.dtype).replace("paddle.", "")
    return {"int8": 1, "uint8": 1, "int32": 4, "float32": 4, "int64": 8, "float64": 8, "float16": 2}.get(
        name, 4
    )


class Int8Compressor(Compressor):
    """int8 values with one fp32 scale per chunk of CHUNK values."""

    name = "int8"

    def __init__(self, chunk: int = CHUNK) -> None:
        super().__init__()
        self.chunk = chunk

    def encode(self, flat: Any) -> List[Any]:
        import paddle

        numel = int(flat.shape[0])
        chunks = -(-numel // self.chunk)
        pad = chunks * self.chunk - numel
        x = paddle.concat([flat, paddle.zeros([pad], dtype="float32")]) if pad else flat
        x = x.reshape([chunks, self.chunk])
        scale = x.abs().max(axis=1, keepdim=True) / 127.0
        safe = paddle.where(scale > 0, scale, paddle.ones_like(scale))
        q = paddle.clip(paddle.round(x / safe), -127, 127).astype("int8")
        return [q, scale.reshape([chunks])]

    def decode(self, payload: Sequence[Any], numel: int) -> Any:
        q, scale = payload
        x = q.astype("float32") * scale.reshape([-1, 1])
        return x.reshape([-1])[:numel]


class _SparseCompressor(Compressor):
    """Sends (index, value) pairs of the gradient plus the residual; what is not sent stays in the
    residual and is added to the next step's gradient (error feedback)."""

    def __init__(self) -> None:
        super().__init__()
        self.residual: Optional[Any] = None

    def _with_residual(self, flat: Any) -> Any:
        import paddle

        if self.residual is None or int(self.residual.shape[0]) != int(flat.shape[0]):
            self.residual = paddle.zeros_like(flat)
        return flat + self.residual

    def _send(self, acc: Any, idx: Any) -> List[Any]:
        """The payload for entries ``idx`` of ``acc``; the rest becomes the residual."""
        import paddle

        values = paddle.gather(acc, idx)
        self.residual = paddle.scatter(acc, idx, paddle.zeros_like(values))
        return [idx.astype("int32"), values]

    def decode(self, payload: Sequence[Any], numel: int) -> Any:
        import paddle

        idx, values = payload
        out = paddle.zeros([numel], dtype="float32")
        if int(idx.shape[0]) == 0:
            return out
        return paddle.scatter(out, idx.astype("int64"), values, overwrite=False)


class TopKCompressor(_SparseCompressor):
    """Largest-magnitude entries with error feedback."""

    name = "topk"

    def __init__(self, ratio: float) -> None:
        super().__init__()
        self.ratio = ratio

    def k_for(self, numel: int) -> int:
        return max(1, int(math.ceil(self.ratio * numel)))

    def encode(self, flat: Any) -> List[Any]:
        import paddle

        acc = self._with_residual(flat)
        _, idx = paddle.topk(acc.abs(), self.k_for(int(flat.shape[0])))
        return self._send(acc, idx)


class ThresholdCompressor(_SparseCompressor):
    """Entries whose magnitude reaches ``threshold``, with error feedback."""

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def encode(self, flat: Any) -> List[Any]:
        import paddle

        acc = self._with_residual(flat)
        return self._send(acc, paddle.nonzero(acc.abs() >= self.threshold).reshape([-1]))

    def equalise(self, payload: List[Any], group: Any) -> List[Any]:
        """Pad to the largest count in the group with index 0 / value 0 (decode adds, so padding adds 0)."""
        import paddle
        import paddle.distributed as dist

        idx, values = payload
        counts: List[Any] = []
        dist.all_gather(counts, paddle.to_tensor([int(idx.shape[0])], dtype="int64"), group=group)
        pad = max(int(c.numpy()[0]) for c in counts) - int(idx.shape[0])
        if pad:
            idx = paddle.concat([idx, paddle.zeros([pad], dtype="int32")])
            values = paddle.concat([values, paddle.zeros([pad], dtype=values.dtype)])
        return [idx, values]


def make_compressor(par: Optional[Any]) -> Optional[Compressor]:
    """The compressor for parallel_config.gradient_compression (None when off)."""
    if par is None or par.gradient_compression == "none":
        return None
    if par.gradient_compression == "int8":
        return Int8Compressor()
    if par.gradient_compression == "topk":
        return TopKCompressor(par.topk_ratio)
    if par.gradient_compression == "threshold":
        return ThresholdCompressor(par.compression_threshold)
    raise ValueError(f"unknown gradient_compression {par.gradient_compression!r}")
