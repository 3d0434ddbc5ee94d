"""The generated demo tasks: correct answers, a real held-out split, determinism, one token per character."""

from __future__ import annotations

import json

import pytest

from bmtrain_cli.data.demo import (
    TASKS,
    WORD_HELDOUT,
    WORD_LEN,
    WORD_TRAIN,
    demo_records,
    train_demo_tokenizer,
    write_demo_data,
)


def _read(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("task", ["reverse", "rotate"])
def test_word_tasks_answers_and_split(task):
    train, held = demo_records(task, seed=0)
    assert len(train) == WORD_TRAIN and len(held) == WORD_HELDOUT
    for rec in train[:200] + held:
        word = rec["input"][:-1]
        assert rec["input"].endswith("=") and len(word) == WORD_LEN and word.isalpha() and word.islower()
        expected = word[::-1] if task == "reverse" else word[-1] + word[:-1]
        assert rec["output"] == expected
    held_prompts = {r["input"] for r in held}
    assert len(held_prompts) == len(held)  # distinct held-out problems
    assert not held_prompts & {r["input"] for r in train}  # no held-out prompt is trained on


def test_tasks_differ_and_are_deterministic():
    rev_a, _ = demo_records("reverse", seed=0)
    rev_b, _ = demo_records("reverse", seed=0)
    rot, _ = demo_records("rotate", seed=0)
    rev_other, _ = demo_records("reverse", seed=1)
    assert rev_a == rev_b
    assert [r["input"] for r in rev_a] != [r["input"] for r in rot]
    assert rev_a != rev_other


def test_arithmetic_split_covers_every_pair_once():
    train, held = demo_records("arithmetic", seed=0)
    assert len(train) + len(held) == 100 * 100 and len(held) == 500
    prompts = [r["input"] for r in train + held]
    assert len(set(prompts)) == len(prompts)
    for rec in held[:50]:
        a, b = rec["input"][:-1].split("+")
        assert rec["output"] == str(int(a) + int(b))


def test_write_demo_data_files(tmp_path):
    train_path, held_path = write_demo_data(str(tmp_path / "d"), task="reverse")
    assert _read(train_path) == demo_records("reverse")[0]
    assert _read(held_path) == demo_records("reverse")[1]
    assert not list((tmp_path / "d").glob("*.tmp"))


def test_unknown_task_names_the_available_ones(tmp_path):
    with pytest.raises(ValueError, match="reverse"):
        write_demo_data(str(tmp_path), task="sorting")
    assert set(TASKS) == {"reverse", "rotate", "arithmetic"}


def test_demo_tokenizer_one_token_per_character(tmp_path):
    from bmtrain_cli.data.encode import encode_prompt

    train_path, held_path = write_demo_data(str(tmp_path / "d"), task="reverse")
    tok = train_demo_tokenizer(str(tmp_path / "tok"), [train_path, held_path])
    rec = _read(held_path)[0]
    ids, answer = encode_prompt(rec, tok, "auto", "auto")
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(rec["input"])
    assert [tok.decode([i]) for i in ids[1:]] == list(rec["input"])
    assert answer == rec["output"]
    assert [tok.decode([i]) for i in tok.encode(answer)] == list(answer)
    # the rotate task (LoRA stage 2) tokenises the same way with the reverse task's tokenizer
    rot = demo_records("rotate")[1][0]
    assert len(tok.encode(rot["input"] + rot["output"])) == 2 * WORD_LEN + 1


@pytest.mark.parametrize("task", TASKS)
def test_config_accepts_demo_task(task):
    from bmtrain_cli.config.load import load_config

    loaded = load_config("configs/quickstart.yaml", overrides=[f"train_config.demo_data={task}"])
    assert loaded.config.train.demo_data == task
