"""The decoding batch's preallocated KV cache (serve/kv_slots.py) against per-row lists of keys: rows of
different lengths join in blocks, decode steps write in place, rows leave (the last row taking their
place), the buffers shift and grow; after every operation each row's unmasked keys and values are
exactly its own tokens, in order."""

from __future__ import annotations

from typing import List

import numpy as np
import paddle
import pytest

from bmtrain_cli.serve import kv_slots
from bmtrain_cli.serve.kv_slots import SlotCache

KV_HEADS, DIM, LAYERS = 2, 3, 2


class Reference:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.rows: List[List[np.ndarray]] = []  # per row: its tokens' keys [LAYERS, KV_HEADS, DIM]

    def token(self) -> np.ndarray:
        return self.rng.standard_normal((LAYERS, KV_HEADS, DIM)).astype("float32")


def _join(cache: SlotCache, ref: Reference, lengths: List[int]) -> None:
    p = max(lengths)
    keys = ref.rng.standard_normal((LAYERS, len(lengths), p, KV_HEADS, DIM)).astype("float32")  # pads: junk
    mask = np.zeros((len(lengths), p), dtype=np.int64)
    for i, n in enumerate(lengths):
        toks = [ref.token() for _ in range(n)]
        for j, t in enumerate(toks):
            keys[:, i, p - n + j] = t
        mask[i, p - n :] = 1
        ref.rows.append(toks)
    tensors = [paddle.to_tensor(keys[layer]) for layer in range(LAYERS)]
    cache.join(tensors, [-t for t in tensors], mask)
    for layer in range(LAYERS):  # the values went in with the keys
        live = cache.values[layer].numpy()[: cache.rows, :, cache.start : cache.end]
        np.testing.assert_array_equal(
            live, -cache.keys[layer].numpy()[: cache.rows, :, cache.start : cache.end]
        )


def _step(cache: SlotCache, ref: Reference) -> None:
    """One decode step through ``update``: the views it returns hold each row's tokens under the mask."""
    cache.reserve(1)
    mask, past = cache.step_mask(), len(cache)
    new = [ref.token() for _ in ref.rows]
    for layer in range(LAYERS):
        k = paddle.to_tensor(np.stack([t[layer] for t in new])[:, None])
        keys, values = cache.update(layer, k, -k)
        assert keys.shape[1] == mask.shape[1] == past + 1
        for i, toks in enumerate(ref.rows):
            want = np.stack([t[layer] for t in [*toks, new[i]]])
            got = keys.numpy()[i][mask[i] == 1]
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(values.numpy()[i][mask[i] == 1], -want)
    assert len(cache) == past + 1  # the column is the cache's once the last layer wrote it
    for toks, t in zip(ref.rows, new):
        toks.append(t)


def _check(cache: SlotCache, ref: Reference) -> None:
    assert cache.rows == len(ref.rows) and cache.mask.shape == (cache.rows, len(cache))
    if not ref.rows:
        return
    assert cache.mask.any(axis=0)[0]  # no column that every row pads is kept
    for layer in range(LAYERS):
        live = cache.keys[layer].numpy()[: cache.rows, :, cache.start : cache.end].transpose(0, 2, 1, 3)
        for i, toks in enumerate(ref.rows):
            np.testing.assert_array_equal(live[i][cache.mask[i] == 1], np.stack([t[layer] for t in toks]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_keep_their_own_keys_through_joins_steps_and_drops(seed, monkeypatch):
    monkeypatch.setattr(kv_slots, "MIN_CAPACITY", 4)  # small buffers: shifts and growth happen
    rng = np.random.default_rng(seed)
    ref = Reference(rng)
    cache = SlotCache(LAYERS, max_rows=6)
    capacities = set()
    for _ in range(40):
        op = rng.integers(0, 3)
        room = 6 - cache.rows
        if op == 0 and room:
            _join(cache, ref, [int(n) for n in rng.integers(1, 9, size=int(rng.integers(1, room + 1)))])
        elif op == 1 and cache.rows:
            _step(cache, ref)
        elif op == 2 and cache.rows:
            gone = sorted({int(i) for i in rng.integers(0, cache.rows, size=int(rng.integers(1, 3)))})
            order = cache.drop(gone)
            assert sorted(order) == [i for i in range(len(ref.rows)) if i not in gone]
            ref.rows = [ref.rows[i] for i in order]
        _check(cache, ref)
        capacities.add(cache.capacity)
    assert len(capacities) > 1  # the buffers grew at least once
