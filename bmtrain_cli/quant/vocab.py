"""The vocabulary matrices of a quantised base in int8: the input embedding and the LM head (tied or not),
when ``model_config.quantization.skip_modules`` leaves ``embed_tokens`` (and ``lm_head``) out.

Both are a frozen matrix ``[vocab, hidden]`` held as one int8 code per element and one fp32 absmax scale per
vocabulary row (bmtrain_cli/quant/formats.py's int8: ``scale = max|row| / 127``): the format of the int8
linear layer, whose output channels are the head's vocabulary rows. A tied model's head reads the
embedding's codes, so one set of codes stands for both.

* The embedding lookup gathers the int8 rows of the tokens and dequantises only those rows.
* The LM head's loss (:func:`head_cross_entropy`) runs over chunks of the vocabulary, dequantising one
  chunk of rows at a time, in one pass: an online log-sum-exp, and for the input gradient the online
  softmax-weighted sum of the head rows (as flash attention accumulates its output), so neither the
  full fp32 head nor the [tokens, vocab] logits exist at once, and each head row is dequantised once a
  step. The head is frozen: the backward gives the hidden states' gradient only.

The embedding and an untied head are quantised in blocks of vocabulary rows (:func:`quantize_rows`, at
most :data:`ROW_BLOCK_WEIGHTS` weights at a time): a scale per row makes each block's codes those of the
whole matrix, byte for byte. Loading a checkpoint reads them from the file block by block
(models/safetensors_io.py ``LazyTensors.row_reader``), so its full-precision matrix never exists whole.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Tuple, Union

import numpy as np
import paddle
from paddle import nn
from paddle.autograd import PyLayer

from bmtrain_cli.ops.loss_chunks import CPU_CHUNK_ELEMENTS, QUANT_HEAD_CHUNK_WEIGHTS
from bmtrain_cli.quant import formats

# per chunk of the loss: at most this many logits and this many dequantised head weights
CHUNK_LOGITS = CPU_CHUNK_ELEMENTS
CHUNK_WEIGHTS = QUANT_HEAD_CHUNK_WEIGHTS
ROW_BLOCK_WEIGHTS = 1 << 22  # weights quantised at once while the embedding is quantised (16 MiB in fp32)
RowReader = Callable[[int, int], np.ndarray]  # (r0, r1) -> rows r0..r1 of a [vocab, hidden] matrix


class VocabCodes:
    """A [vocab, hidden] int8 matrix: ``codes`` uint8 [vocab * hidden] (the int8 bytes, read as signed),
    ``scales`` fp32 [vocab]."""

    def __init__(self, codes: paddle.Tensor, scales: paddle.Tensor, hidden: int):
        self.codes, self.scales, self.hidden = codes, scales, int(hidden)
        self.vocab = int(scales.shape[0])

    def rows(self, r0: int, r1: int) -> paddle.Tensor:
        """Rows r0..r1 dequantised, fp32 [r1 - r0, hidden]."""
        codes = paddle.view(self.codes[r0 * self.hidden : r1 * self.hidden], "int8")
        return codes.astype("float32").reshape([r1 - r0, self.hidden]) * self.scales[r0:r1].unsqueeze(-1)

    def lookup(self, ids: paddle.Tensor) -> paddle.Tensor:
        """The rows of ``ids`` (any shape), dequantised: fp32 [*ids.shape, hidden]."""
        flat = ids.reshape([-1]).astype("int64")
        codes = paddle.gather(paddle.view(self.codes, "int8").reshape([self.vocab, self.hidden]), flat)
        out = codes.astype("float32") * paddle.gather(self.scales, flat).unsqueeze(-1)
        return out.reshape([*ids.shape, self.hidden])

    def chunks(self, tokens: int) -> Iterator[Tuple[int, int]]:
        """(r0, r1) vocabulary chunks of the loss over ``tokens`` hidden states."""
        step = max(1, min(self.vocab, CHUNK_LOGITS // max(tokens, 1), CHUNK_WEIGHTS // self.hidden))
        for r0 in range(0, self.vocab, step):
            yield r0, min(self.vocab, r0 + step)

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """hidden [..., hidden] @ W^T: the logits [..., vocab], a chunk of the head dequantised at a time
        (the gradient flows to ``hidden`` only)."""
        flat = hidden.reshape([-1, self.hidden])
        parts = [
            paddle.matmul(flat, self.rows(r0, r1).astype(hidden.dtype), transpose_y=True)
            for r0, r1 in self.chunks(int(flat.shape[0]))
        ]
        return paddle.concat(parts, axis=-1).reshape([*hidden.shape[:-1], self.vocab])


def _head_loss(
    head: VocabCodes, hidden: paddle.Tensor, labels: paddle.Tensor, ignore_index: int, need_grad: bool
) -> Tuple[paddle.Tensor, Optional[paddle.Tensor]]:
    """(sum of the token losses fp32, the gradient of that sum with respect to ``hidden`` or None), in one
    pass over the vocabulary chunks: a running maximum m and sum s of exp(logit - m) per token, and for
    the gradient the running sum of exp(logit - m) times the head rows, rescaled as m grows; at the end
    that sum / s is softmax @ W, and the gradient softmax @ W - W[label]."""
    n = int(hidden.shape[0])
    valid = labels != ignore_index
    safe = paddle.where(valid, labels, paddle.zeros_like(labels)).astype("int64")
    validf = valid.astype("float32")
    run_max = paddle.full([n], float("-inf"), dtype="float32")
    run_sum = paddle.zeros([n], dtype="float32")
    picked = paddle.zeros([n], dtype="float32")
    weighted = paddle.zeros([n, head.hidden], dtype="float32") if need_grad else None
    for r0, r1 in head.chunks(n):
        w = head.rows(r0, r1).astype(hidden.dtype)
        logits = paddle.matmul(hidden, w, transpose_y=True).astype("float32")
        new_max = paddle.maximum(run_max, logits.max(axis=1))
        rescale = paddle.exp(run_max - new_max)
        probs = paddle.exp(logits - new_max.unsqueeze(-1))
        run_sum = run_sum * rescale + probs.sum(1)
        run_max = new_max
        if weighted is not None:
            product = paddle.matmul(probs.astype(hidden.dtype), w).astype("float32")
            weighted = weighted * rescale.unsqueeze(-1) + product
        inside = (safe >= r0) & (safe < r1)
        at = paddle.clip(safe - r0, 0, r1 - r0 - 1).unsqueeze(-1)
        picked = picked + paddle.where(inside, paddle.take_along_axis(logits, at, axis=1).squeeze(-1), 0.0)
    total = ((run_max + paddle.log(run_sum) - picked) * validf).sum()
    if weighted is None:
        return total, None
    grad = weighted / run_sum.unsqueeze(-1) - head.lookup(safe).astype("float32")
    return total, grad * validf.unsqueeze(-1)


class _HeadCrossEntropy(PyLayer):
    @staticmethod
    def forward(ctx: Any, hidden: paddle.Tensor, head: VocabCodes, labels: paddle.Tensor, ignore: int) -> Any:
        total, grad = _head_loss(head, hidden, labels, ignore, True)
        ctx.save_for_backward(grad)
        ctx.dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: paddle.Tensor) -> paddle.Tensor:
        (grad,) = ctx.saved_tensor()
        return (grad * grad_loss.astype("float32")).astype(ctx.dtype)


def head_cross_entropy(
    head: VocabCodes, hidden: paddle.Tensor, labels: paddle.Tensor, ignore_index: int = -100
) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(sum of the next-token losses fp32, number of counted labels fp32) of ``hidden`` [tokens, hidden]
    against ``labels`` [tokens] through the int8 head, one vocabulary chunk dequantised at a time."""
    labels = labels.reshape([-1])
    count = (labels != ignore_index).astype("float32").sum()
    if paddle.is_grad_enabled() and not hidden.stop_gradient:
        return _HeadCrossEntropy.apply(hidden, head, labels, int(ignore_index)), count
    return _head_loss(head, hidden, labels, int(ignore_index), False)[0], count


def quantize_rows(read: RowReader, vocab: int, hidden: int) -> Tuple[paddle.Tensor, paddle.Tensor]:
    """(codes uint8 [vocab * hidden], scales fp32 [vocab]) of a [vocab, hidden] matrix in int8 (formats.py,
    a scale per row), quantised ``read(r0, r1)`` one block of rows at a time into the tensors it returns:
    the same bytes as quantising the whole matrix, with one block's temporaries."""
    codes = paddle.empty([vocab * hidden], dtype="uint8")
    scales = paddle.empty([vocab], dtype="float32")
    step = max(1, ROW_BLOCK_WEIGHTS // max(hidden, 1))
    for r0 in range(0, vocab, step):
        r1 = min(vocab, r0 + step)
        block_codes, block_scales = formats.quantize_int8(np.asarray(read(r0, r1), np.float32))
        codes[r0 * hidden : r1 * hidden] = paddle.to_tensor(block_codes.view(np.uint8).reshape(-1))
        scales[r0:r1] = paddle.to_tensor(block_scales)
    codes.stop_gradient = scales.stop_gradient = True
    return codes, scales


class QuantEmbedding(nn.Layer):
    """A frozen input embedding [vocab, hidden] in int8 with per-row scales (non-persistable buffers:
    not in ``state_dict()``, so a QLoRA run saves only its adapters). ``weight``: the matrix, or
    ``(read, vocab, hidden)`` to read it a block of rows at a time (:func:`quantize_rows`)."""

    method = "int8"
    impl = "reference"

    def __init__(self, weight: Union[np.ndarray, Tuple[RowReader, int, int]], dtype: str) -> None:
        super().__init__()
        if isinstance(weight, tuple):
            read, vocab, hidden = weight
        else:
            whole = np.asarray(weight)
            vocab, hidden = whole.shape
            read = lambda r0, r1: whole[r0:r1]  # noqa: E731
        codes, scales = quantize_rows(read, vocab, hidden)
        self.num_embeddings, self.embedding_dim = int(vocab), int(hidden)
        self.nbytes = int(codes.shape[0]) + 4 * int(scales.shape[0])
        self.compute_dtype = dtype
        self.register_buffer("codes", codes, persistable=False)
        self.register_buffer("scales", scales, persistable=False)

    def vocab_codes(self) -> VocabCodes:
        return VocabCodes(self.codes, self.scales, self.embedding_dim)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        dtype: Any = self.compute_dtype
        return self.vocab_codes().lookup(ids).astype(dtype)

    def dequantized_weight(self) -> paddle.Tensor:
        """The embedding [vocab, hidden] (nn.Embedding's layout) in the compute dtype."""
        dtype: Any = self.compute_dtype
        return self.vocab_codes().rows(0, self.num_embeddings).astype(dtype)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, hidden={self.embedding_dim}, int8"
