"""Preference records, truncation, pair batches (packed and not) and the pair loader."""

from __future__ import annotations

import numpy as np
import pytest

from bmtrain_cli.data.formats import BadRecord
from bmtrain_cli.errors import UserError
from bmtrain_cli.preference.batches import collate_pairs, truncate_pair
from bmtrain_cli.preference.demo import near_miss, write_demo_pairs
from bmtrain_cli.preference.loader import build_preference_loader
from bmtrain_cli.preference.pairs import parse_pair
from tests.unit.preference.conftest import make_config

PAIRS = [
    {"prompt": f"{w}=", "chosen": w[::-1], "rejected": w}
    for w in ("abcde", "qrstu", "kqzfa", "mnopq", "vwxyz")
]


def test_parse_pair_forms():
    chosen, rejected = parse_pair({"prompt": "hi", "chosen": "a", "rejected": "b", "system": "s"})
    assert chosen.messages == (("user", "hi"), ("assistant", "a")) and chosen.system == "s"
    assert rejected.messages[-1] == ("assistant", "b")
    chat = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
        "chosen": [{"role": "assistant", "content": "good"}],
        "rejected": "bad",
    }
    chosen, rejected = parse_pair(chat)
    assert chosen.system == "s" and chosen.messages == (("user", "q"), ("assistant", "good"))
    assert rejected.messages == (("user", "q"), ("assistant", "bad"))


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "p", "chosen": "a"}, 'missing field "rejected"'),
        ({"prompt": "p", "chosen": "a", "rejected": "a"}, "the same text"),
        ({"chosen": "a", "rejected": "b"}, 'missing field "prompt"'),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "must be a string"),
        (
            {
                "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
                "chosen": "a",
                "rejected": "b",
            },
            "must end with a user turn",
        ),
    ],
)
def test_bad_pairs_say_why(record, reason):
    with pytest.raises(BadRecord, match=reason):
        parse_pair(record)


def test_bad_record_is_file_line_or_skipped(tmp_path, letters_tok, write_jsonl):
    path = write_jsonl([PAIRS[0], "{not json", {"prompt": "x=", "chosen": "y"}, PAIRS[1]])
    cfg = make_config(tmp_path, data_path=path)
    with pytest.raises(UserError, match=r"pairs.jsonl:2: .*1 more bad record"):
        build_preference_loader(cfg, letters_tok)
    loader = build_preference_loader(make_config(tmp_path, data_path=path, on_bad_record="skip"), letters_tok)
    assert len(loader.dataset) == 2 and loader.dataset.rejected_count == 2
    assert [r["line"] for r in loader.dataset.rejected()] == [2, 3]
    again = build_preference_loader(make_config(tmp_path, data_path=path, on_bad_record="skip"), letters_tok)
    assert not any(s.built for s in again.dataset.stores)  # the cache was reused


def test_pairs_share_the_prompt_and_train_the_responses(tmp_path, letters_tok, write_jsonl):
    loader = build_preference_loader(make_config(tmp_path, data_path=write_jsonl(PAIRS)), letters_tok)
    (ci, cm), (ri, rm) = loader.dataset.pair(0)
    first = int(np.argmax(cm))
    assert first == int(np.argmax(rm)) and (ci[:first] == ri[:first]).all()
    assert letters_tok.decode([int(t) for t in ci[first:][cm[first:]] if t != letters_tok.eos_id]) == "edcba"


def _sample(prompt: int, response: int, bos: bool = True):
    ids = np.arange(100, 100 + prompt + response)
    mask = np.r_[np.zeros(prompt, bool), np.ones(response, bool)]
    if bos:
        ids, mask = np.r_[1, ids], np.r_[False, mask]
    return ids, mask


def test_truncation_keeps_the_prompt_and_cuts_the_responses():
    (c, cm), (r, rm) = truncate_pair(_sample(6, 10), _sample(6, 3), 12, bos_id=1)
    assert len(c) == 12 and list(c[:7]) == [1, *range(100, 106)] and cm[7:].all()  # prompt whole
    assert len(r) == 10 and (r == _sample(6, 3)[0]).all()  # the shorter response needs no cut
    # a prompt that leaves less than half the budget keeps its last tokens, after BOS
    (c, cm), (r, _) = truncate_pair(_sample(20, 10), _sample(20, 2), 12, bos_id=1)
    assert len(c) == 12 and c[0] == 1 and cm.sum() == 5 and list(c[1:7]) == list(range(114, 120))
    assert list(r[:6]) == list(c[:6])  # both keep the same prompt tokens


def test_packed_pairs_keep_sequences_apart():
    pairs = [(_sample(3, 4), _sample(3, 2)), (_sample(2, 5), _sample(2, 1))]
    flat = collate_pairs(pairs, 0, width=None, packed=False, max_len=16)
    packed = collate_pairs(pairs, 0, width=None, packed=True, max_len=16)
    assert flat["input_ids"].shape[0] == 4 and packed["input_ids"].shape[0] < 4
    # every sequence has its own segment id, so chosen and rejected of a pair never attend to each other
    for b in (flat, packed):
        idx = b["sequence_index"]
        counts = np.bincount(idx[idx >= 0], minlength=4)
        assert list(counts) == [4, 2, 5, 1]
        for s in range(4):
            r, c = np.nonzero(idx == s)
            assert len(set(b["attention_mask"][r, c].tolist())) == 1 and len(set(r.tolist())) == 1
    assert (packed["attention_mask"].max(axis=1) > 1).any()  # rows hold several sequences


def test_loader_shards_and_resumes(tmp_path, letters_tok, write_jsonl):
    path = write_jsonl(PAIRS)
    one = build_preference_loader(make_config(tmp_path, data_path=path, micro_batch_size=4), letters_tok)
    cfg2 = make_config(tmp_path, data_path=path, micro_batch_size=2)
    ranks = [build_preference_loader(cfg2, letters_tok, data_rank=r, data_world=2) for r in (0, 1)]
    it1, its = iter(one), [iter(x) for x in ranks]
    for _ in range(3):  # each step, the two ranks together hold the single process's pairs
        want = sorted(next(it1)["pair_ids"].tolist())
        assert sorted(next(its[0])["pair_ids"].tolist() + next(its[1])["pair_ids"].tolist()) == want
    state = one.state_dict()
    nxt = next(it1)["pair_ids"].tolist()
    again = build_preference_loader(make_config(tmp_path, data_path=path, micro_batch_size=4), letters_tok)
    again.load_state_dict(state)
    assert next(iter(again))["pair_ids"].tolist() == nxt


def test_demo_pairs_are_near_misses(tmp_path):
    import json
    import random

    paths = write_demo_pairs(str(tmp_path))
    rec = json.loads(open(paths["pairs_train"]).readline())
    assert rec["chosen"] == rec["prompt"][:-1][::-1] and rec["rejected"] != rec["chosen"]
    rng = random.Random(0)
    for word in ("abcde", "aabbb", "zzzzz"):
        miss = near_miss(word, rng)
        assert miss != word and len(miss) == len(word)
        assert sum(a != b for a, b in zip(miss, word)) <= 2
    held = {json.loads(x)["input"] for x in open(paths["heldout"])}
    train = {json.loads(x)["prompt"] for x in open(paths["pairs_train"])}
    assert held and not held & train
