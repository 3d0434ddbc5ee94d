"""cu_seqlens once per batch: the offsets the model hands every layer on a GPU equal the per-layer
computation they replace, and are computed once however many layers (and recomputed forwards) read them."""

from __future__ import annotations

import numpy as np
import paddle

from bmtrain_cli.models import attention as att
from bmtrain_cli.models.attention import SegmentIds, batch_segments, cu_seqlens

PACKED = [
    [[1] * 9 + [2] * 14 + [3] * 6 + [0] * 8, [1] * 30 + [2] * 7],
    [[1] * 37, [1] * 20 + [0] * 17],
    [[0] * 5 + [1] * 32, [1, 2, 3, 4] * 9 + [0]],
]


def _runs(rows):
    """Independent reference: start offsets of runs of equal ids laid end to end (runs never cross rows)."""
    starts, offset = [], 0
    for row in rows:
        for i, v in enumerate(row):
            if i == 0 or row[i - 1] != v:
                starts.append(offset + i)
        offset += len(row)
    return starts + [offset]


def test_once_per_batch_equals_per_layer_computation():
    for rows in PACKED:
        mask = paddle.to_tensor(np.asarray(rows, dtype="int32"))
        held = batch_segments(mask, on_gpu=True)
        assert isinstance(held, SegmentIds)
        per_layer = [cu_seqlens(mask.astype("int64")).numpy() for _ in range(4)]  # the old way
        once = [held.cu_seqlens().numpy() for _ in range(4)]
        for old, new in zip(per_layer, once):
            np.testing.assert_array_equal(old, new)
            np.testing.assert_array_equal(new, _runs(rows))
        assert held.computed == 1
        assert new.dtype == np.int32
        # the layers of one pipeline stage receive the same mask tensor: they share the holder
        assert batch_segments(mask, on_gpu=True) is held


def test_cpu_keeps_the_plain_tensor():
    mask = paddle.to_tensor(np.asarray(PACKED[0], dtype="int32"))
    out = batch_segments(mask, on_gpu=False)
    assert isinstance(out, paddle.Tensor) and out.dtype == paddle.int64


def test_attend_reads_the_held_ids_and_model_layers_share_one(monkeypatch):
    """Through the model: every layer's attend gets the same SegmentIds (simulated GPU, fp32 -> sdpa)."""
    from bmtrain_cli.models.decoder import CausalLM
    from tests.unit.models.tiny import TINY

    seen = []
    real = att.attend

    def spy(q, k, v, mask, *a, **kw):
        seen.append(mask)
        return real(q, k, v, mask, *a, **kw)

    monkeypatch.setattr(att, "_on_gpu", lambda: True)
    monkeypatch.setattr(att, "gpu_capability", lambda: (9, 0))
    import bmtrain_cli.models.blocks as dec

    monkeypatch.setattr(dec, "attend", spy)
    paddle.seed(0)
    model = CausalLM(TINY, kernels="reference")
    ids = paddle.to_tensor(np.random.RandomState(0).randint(3, TINY.vocab_size, size=(2, 37)))
    mask = paddle.to_tensor(np.asarray(PACKED[0], dtype="int64"))
    got = model.hidden_states(ids, mask)
    assert len(seen) == TINY.num_hidden_layers and all(m is seen[0] for m in seen)
    assert isinstance(seen[0], SegmentIds)
    monkeypatch.setattr(att, "_on_gpu", lambda: False)
    want = model.hidden_states(ids, mask)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-5)
