"""The decoding batch's KV cache, preallocated and written in place (serve/batching.py's rows).

Per layer one zeroed buffer [max rows, kv_heads, capacity, head_dim] for the keys and one for the
values (heads before positions: the attention reads each row's heads as they lie, where a [rows,
positions, heads, d] cache would first be transposed, which costs a CPU more than the attention itself). Batch row i is buffer row i; the live columns are ``start:end``, every row's tokens right-aligned
at ``end`` (left padding before them, which the attention mask hides). A decode step writes one column
per layer in place and the model attends over views of the live part; joining rows are copied in as one
block, a leaving row is replaced by the last row (one row copied), and columns every row pads are
dropped by moving ``start``. Nothing is copied per step beyond what the attention reads, and the buffers
grow (doubling) only when a row gets longer than their capacity."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import paddle

from bmtrain_cli.models.blocks import KVCache

MIN_CAPACITY = 256  # columns of a first allocation


class SlotCache:
    """Duck-types ``models.blocks.KVCache`` for the model's forward (``len`` and ``update``)."""

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.keys: List[paddle.Tensor] = []
        self.values: List[paddle.Tensor] = []
        self.rows = 0
        self.start = 0
        self.end = 0
        self.mask = np.zeros((0, 0), dtype=np.int64)  # [rows, end - start]: 1 real token, 0 padding

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """Write the step's keys/values [rows, s, ...] at ``end`` (room made by ``reserve``) and return
        the live views; after the last layer the columns belong to the cache."""
        s = int(k.shape[1])
        n, a, b = self.rows, self.end, self.end + s
        self.keys[layer][:n, :, a:b] = k.transpose([0, 2, 1, 3])
        self.values[layer][:n, :, a:b] = v.transpose([0, 2, 1, 3])
        out = (
            self.keys[layer][:n, :, self.start : b].transpose([0, 2, 1, 3]),
            self.values[layer][:n, :, self.start : b].transpose([0, 2, 1, 3]),
        )
        if layer == self.num_layers - 1:
            self.end = b
            self.mask = np.concatenate([self.mask, np.ones((n, s), dtype=np.int64)], axis=1)
        return out

    def step_mask(self, s: int = 1) -> np.ndarray:
        """The attention mask of a step feeding ``s`` new tokens per row: the live columns and the new."""
        return np.concatenate([self.mask, np.ones((self.rows, s), dtype=np.int64)], axis=1)

    def reserve(self, s: int) -> None:
        """Room for ``s`` more columns after ``end``: shift the live part to column 0, or grow."""
        if self.end + s <= self.capacity:
            return
        width = self.end - self.start
        if self.start and width + s <= self.capacity:
            self._move(self.start, 0)
            return
        self._grow(max(2 * self.capacity, width + s, MIN_CAPACITY))

    def join(self, keys: Sequence[paddle.Tensor], values: Sequence[paddle.Tensor], mask: np.ndarray) -> None:
        """Add prefilled rows: per layer their keys/values [m, p, ...] (left-padded to p tokens) and
        their mask [m, p]."""
        m, p = mask.shape
        assert self.rows + m <= self.max_rows
        if not self.keys:
            shape = [self.max_rows, keys[0].shape[2], max(MIN_CAPACITY, 2 * p), keys[0].shape[3]]
            self.keys = [paddle.zeros(shape, dtype=keys[0].dtype) for _ in range(self.num_layers)]
            self.values = [paddle.zeros(shape, dtype=keys[0].dtype) for _ in range(self.num_layers)]
        if not self.rows:
            self.start = self.end = 0
        if p > self.end:  # room on the left for the new rows' tokens
            self.reserve(p - self.end)
            self._move(self.start, self.start + p - self.end)
        n, a = self.rows, self.end - p
        for layer in range(self.num_layers):
            self.keys[layer][n : n + m, :, a : self.end] = keys[layer].transpose([0, 2, 1, 3])
            self.values[layer][n : n + m, :, a : self.end] = values[layer].transpose([0, 2, 1, 3])
        lead = max(self.start - a, 0)
        self.start = min(self.start, a)
        old = np.pad(self.mask, ((0, 0), (lead, 0)))
        new = np.pad(mask, ((0, 0), (self.end - self.start - p, 0)))
        self.mask = np.concatenate([old, new], axis=0)
        self.rows += m
        self._trim()

    def drop(self, rows: Sequence[int]) -> List[int]:
        """Remove ``rows``: each is replaced by the last row. Returns the new order (old row indices),
        then drops the columns every remaining row pads."""
        order = list(range(self.rows))
        for i in sorted(rows, reverse=True):
            last = self.rows - 1
            if i != last:
                for bufs in (self.keys, self.values):
                    for buf in bufs:
                        buf[i, :, self.start : self.end] = buf[last, :, self.start : self.end]
                self.mask[i] = self.mask[last]
                order[i] = order[last]
            order.pop()
            self.rows -= 1
        self.mask = self.mask[: self.rows]
        if not self.rows:
            self.start = self.end = 0
            self.mask = np.zeros((0, 0), dtype=np.int64)
            return order
        self._trim()
        return order

    def _trim(self) -> None:
        """Drop the leading columns every row pads."""
        lead = int(np.argmax(self.mask.any(axis=0)))
        self.start += lead
        self.mask = self.mask[:, lead:]

    def _move(self, src: int, dst: int) -> None:
        """Move the live columns to start at ``dst`` (dst + width within the capacity)."""
        width, n = self.end - self.start, self.rows
        if src == dst or not n:
            self.start, self.end = dst, dst + width
            return
        for bufs in (self.keys, self.values):
            for buf in bufs:
                buf[:n, :, dst : dst + width] = buf[:n, :, src : src + width].clone()
        self.start, self.end = dst, dst + width

    def _grow(self, capacity: int) -> None:
        width, n = self.end - self.start, self.rows
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                new = paddle.zeros([buf.shape[0], buf.shape[1], capacity, buf.shape[3]], dtype=buf.dtype)
                new[:n, :, :width] = buf[:n, :, self.start : self.end]
                bufs[i] = new
        self.start, self.end = 0, width


def prefilled(cache: KVCache) -> Tuple[List[paddle.Tensor], List[paddle.Tensor]]:
    """A prefill's keys and values of every layer (none is missing once a prompt ran)."""
    keys = [k for k in cache.keys if k is not None]
    values = [v for v in cache.values if v is not None]
    assert len(keys) == len(values) == len(cache.keys)
    return keys, values
