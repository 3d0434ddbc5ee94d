"""Loader: exact resume, sharding, packing equivalence, truncation, mixing, the token cache."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from bmtrain_cli.data.collate import truncate
from bmtrain_cli.data.loader import build_loader

from .conftest import make_config


def _take(loader, n):
    return [{k: v.copy() for k, v in b.items()} for b in itertools.islice(iter(loader), n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


@pytest.fixture
def small_data(write_jsonl):
    rng = np.random.default_rng(0)
    recs = [
        {"input": f"{a}+{b}=" * int(rng.integers(1, 4)), "output": str(a + b)}
        for a in range(9)
        for b in range(7)
    ]
    return write_jsonl(recs)


@pytest.mark.parametrize("batching,workers", [("longest", 0), ("packed", 1), ("max_length", 1)])
def test_resume_gives_identical_next_batches(tmp_path, sp_tok, small_data, batching, workers):
    cfg = make_config(
        tmp_path, data_path=small_data, micro_batch_size=4, batching=batching, num_workers=workers
    )
    ref = build_loader(cfg, sp_tok)
    steps = 3 * len(ref) + 2  # crosses two epoch boundaries
    expected = _take(ref, steps)
    for cut in (1, len(ref), len(ref) + 3):
        first = build_loader(cfg, sp_tok)
        got = _take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
        resumed = build_loader(cfg, sp_tok)
        resumed.load_state_dict(state)
        got += _take(resumed, steps - cut)
        _same(got, expected)
    # epochs differ in order (seeded per epoch), and a different seed changes the order
    e0, e1 = expected[0]["input_ids"], expected[len(ref)]["input_ids"]
    assert e0.shape != e1.shape or not np.array_equal(e0, e1)


def _sample_keys(batch):
    """(tuple of tokens) of every sample in a batch, read back through segment ids."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["attention_mask"][r]
        for s in np.unique(seg[seg > 0]):
            out.append(tuple(batch["input_ids"][r][seg == s].tolist()))
    return out


@pytest.mark.parametrize("batching", ["longest", "packed"])
def test_each_sample_seen_once_per_epoch_across_ranks(tmp_path, sp_tok, small_data, batching):
    world = 3
    cfg = make_config(tmp_path, data_path=small_data, micro_batch_size=5, batching=batching)
    loaders = [build_loader(cfg, sp_tok, data_rank=r, data_world=world) for r in range(world)]
    n = {len(x) for x in loaders}
    assert len(n) == 1  # every rank takes the same number of steps
    per_epoch = n.pop()
    seen = []
    for ld in loaders:
        batches = _take(ld, per_epoch)
        assert ld.epoch == 0
        for b in batches:
            seen += _sample_keys(b)
    single = build_loader(cfg, sp_tok)
    everything = []
    for b in _take(single, len(single)):
        everything += _sample_keys(b)
    assert sorted(seen) == sorted(everything)
    assert len(everything) == single.stats()["samples_per_epoch"] == 63


def _toy_loss(batch):
    """A deterministic per-token 'loss' that depends on each target's whole visible context.

    Position t predicts labels[t+1] from the tokens of its own segment at positions <= t (and their
    position ids); any leak across samples or wrong position id changes the value.
    """
    ids, lab, seg, pos = (batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids"))
    total, count = 0.0, 0
    for r in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if lab[r, t + 1] == -100 or seg[r, t + 1] != seg[r, t] or seg[r, t] == 0:
                continue
            ctx = [(int(ids[r, j]), int(pos[r, j])) for j in range(t + 1) if seg[r, j] == seg[r, t]]
            h = hash((tuple(ctx), int(lab[r, t + 1]))) % 1000003
            total += h / 1000003.0
            count += 1
    return total, count


def _epoch_loss(loader, loss_fn):
    tot, cnt = 0.0, 0
    for b in _take(loader, len(loader)):
        s, c = loss_fn(b)
        tot, cnt = tot + s, cnt + c
    return tot / cnt, cnt


def test_packed_and_unpacked_give_the_same_mean_loss_toy(tmp_path, sp_tok, small_data):
    results = {}
    for batching in ("max_length", "longest", "packed"):
        cfg = make_config(
            tmp_path, data_path=small_data, micro_batch_size=4, batching=batching, max_seq_len=48
        )
        results[batching] = _epoch_loss(build_loader(cfg, sp_tok), _toy_loss)
    assert results["packed"][1] == results["longest"][1] == results["max_length"][1] > 0
    assert results["packed"][0] == pytest.approx(results["longest"][0], abs=1e-12)
    assert results["max_length"][0] == pytest.approx(results["longest"][0], abs=1e-12)


def test_packed_and_unpacked_give_the_same_mean_loss_model(tmp_path, sp_tok, small_data):
    paddle = pytest.importorskip("paddle")
    from dataclasses import replace

    from bmtrain_cli.models import build
    from tests.tiny import ARCH

    paddle.seed(0)
    arch = replace(ARCH, vocab_size=sp_tok.vocab_size, max_position_embeddings=64)
    model = build(arch, kernels="reference")
    model.eval()

    def loss_fn(b):
        t = {k: paddle.to_tensor(v) for k, v in b.items()}
        with paddle.no_grad():
            s, c = model.loss_sum(t["input_ids"], t["labels"], t["attention_mask"], t["position_ids"])
        return float(s), int(float(c))

    means = {}
    for batching in ("longest", "packed"):
        cfg = make_config(
            tmp_path, data_path=small_data, micro_batch_size=8, batching=batching, max_seq_len=48
        )
        means[batching] = _epoch_loss(build_loader(cfg, sp_tok), loss_fn)
    assert means["packed"][1] == means["longest"][1]
    assert means["packed"][0] == pytest.approx(means["longest"][0], rel=1e-5)


def test_truncation_left_keeps_answer_and_drop_counts(tmp_path, sp_tok, write_jsonl):
    long_prompt = "+".join(str(i) for i in range(40)) + "="
    path = write_jsonl([{"input": long_prompt, "output": "780"}, {"input": "1+1=", "output": "2"}])
    cfg = make_config(tmp_path, data_path=path, micro_batch_size=2, max_seq_len=16, shuffle=False)
    ld = build_loader(cfg, sp_tok)
    st = ld.stats()
    assert st["overlong"] == 1 and st["truncated"] == 1 and st["truncated_answer"] == 0 and st["dropped"] == 0
    b = _take(ld, 1)[0]
    row = b["input_ids"][0]
    assert len(row) == 16 and row[0] == sp_tok.bos_id
    trained = [int(t) for t, lab in zip(row, b["labels"][0]) if lab != -100]
    assert sp_tok.decode(trained) == "780"
    assert sp_tok.decode(row[1:]).endswith("38+39=780")
    drop = build_loader(
        make_config(tmp_path, data_path=path, micro_batch_size=2, max_seq_len=16, truncation="drop"), sp_tok
    )
    assert drop.stats()["dropped"] == 1 and drop.stats()["samples_per_epoch"] == 1


def test_truncate_long_answer_keeps_its_start():
    ids = np.arange(30)
    mask = np.array([False] * 10 + [True] * 20)
    (out, m), kind = truncate(ids, mask, 12, bos_id=0)
    assert kind == 2 and len(out) == 12 and out[0] == 0
    assert list(out[m]) == list(range(10, 16))  # the answer's beginning


def test_mixing_weights(tmp_path, sp_tok, write_jsonl):
    a = write_jsonl([{"input": "1+1=", "output": "2"}] * 10, "a.jsonl")
    b = write_jsonl([{"input": "9+9=", "output": "18"}] * 30, "b.jsonl")
    cfg = make_config(tmp_path, data_path=[a, b], data_weights=[3.0, 1.0], micro_batch_size=40)
    ld = build_loader(cfg, sp_tok)
    batch = _take(ld, 1)[0]
    seqs = [sp_tok.decode(r[m > 0]) for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert seqs.count("1+1=2") == 30 and seqs.count("9+9=18") == 10


def test_cache_reused_while_unchanged(tmp_path, sp_tok, write_jsonl):
    path = write_jsonl([{"input": "1+1=", "output": "2"}, {"text": "hello"}])
    cfg = make_config(tmp_path, data_path=path)
    first = build_loader(cfg, sp_tok).dataset.stores[0]
    again = build_loader(cfg, sp_tok).dataset.stores[0]
    assert first.built and not again.built and first.directory == again.directory
    chat = build_loader(make_config(tmp_path, data_path=path, template="chatml"), sp_tok).dataset.stores[0]
    assert chat.built and chat.directory != first.directory
    with open(path, "a") as f:
        f.write(json.dumps({"input": "2+2=", "output": "4"}) + "\n")
    changed = build_loader(cfg, sp_tok).dataset.stores[0]
    assert changed.built and len(changed) == 3


def test_globs_and_directories(tmp_path, sp_tok, write_jsonl):
    write_jsonl([{"input": "1+1=", "output": "2"}], "x1.jsonl")
    write_jsonl([{"input": "2+1=", "output": "3"}], "x2.jsonl")
    ld = build_loader(make_config(tmp_path, data_path=str(tmp_path / "x*.jsonl")), sp_tok)
    assert ld.stats()["samples"] == 2
    ld = build_loader(make_config(tmp_path, data_path=str(tmp_path)), sp_tok)
    assert ld.stats()["samples"] == 2
