"""KV-cached generation equals full recomputation; sampling; `bmtrain generate` and `bmtrain eval`."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import paddle
import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.models import build, load_pretrained, save_pretrained
from bmtrain_cli.models.decoding import STRIDE_FLAG, SamplingOptions, dense_transposes, sample_next
from bmtrain_cli.models.generate import generate
from tests.unit.models.tiny import TINY


def _model(arch=TINY):
    paddle.seed(0)
    return build(arch)


@pytest.mark.parametrize(
    "arch",
    [
        TINY,
        replace(TINY, family="baichuan", fused_qkv=True, num_key_value_heads=4, position_embedding="alibi"),
        replace(TINY, family="mistral", sliding_window=5),
    ],
    ids=["llama", "alibi", "sliding"],
)
def test_cached_decoding_equals_recomputation(arch):
    m = _model(arch)
    prompts = [[5, 9, 11, 3, 7, 8], [4, 2]]
    cached = generate(m, prompts, SamplingOptions(max_new_tokens=10))
    full = generate(m, prompts, SamplingOptions(max_new_tokens=10), use_cache=False)
    assert cached == full
    assert all(len(o) == 10 for o in cached)
    # a left-padded batch gives what each prompt gives alone
    assert generate(m, [prompts[1]], SamplingOptions(max_new_tokens=10)) == [cached[1]]
    # sampling: same seed, same tokens, with or without cache
    s1 = generate(m, prompts, SamplingOptions(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3))
    s2 = generate(
        m, prompts, SamplingOptions(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3), use_cache=False
    )
    assert s1 == s2


def test_decoding_runs_on_dense_transposes_and_restores_paddles_setting():
    """On a CPU the decoding steps run with Paddle's strided transposes off (its CPU kernels read strided
    views far slower), the same tokens come out, and the setting is restored afterwards."""
    m = _model()
    prompts = [[5, 9, 11, 3, 7, 8], [4, 2]]
    seen = []
    generate(
        m,
        prompts,
        SamplingOptions(max_new_tokens=3),
        on_token=lambda i, t: seen.append(paddle.get_flags([STRIDE_FLAG])),
    )
    assert paddle.get_flags([STRIDE_FLAG])[STRIDE_FLAG] is True
    assert seen and all(f[STRIDE_FLAG] is paddle.is_compiled_with_cuda() for f in seen)
    with dense_transposes():
        inside = generate(m, prompts, SamplingOptions(max_new_tokens=6, temperature=0.8, seed=3))
    assert inside == generate(m, prompts, SamplingOptions(max_new_tokens=6, temperature=0.8, seed=3))
    assert paddle.get_flags([STRIDE_FLAG])[STRIDE_FLAG] is True


def _sample_row_by_row(logits, temperature, top_p, rng):
    """sample_next's rule one row at a time with rng.choice (the reference for its vectorised draw)."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(-1, keepdims=True)
    out = []
    for p in probs:
        order = np.argsort(-p, kind="stable")
        sorted_p = p[order]
        keep = (np.cumsum(sorted_p) - sorted_p) < top_p
        keep[0] = True
        kept = sorted_p * keep
        out.append(order[rng.choice(len(kept), p=kept / kept.sum())])
    return np.asarray(out)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_prompt_samples_the_same_whenever_the_others_stop(use_cache):
    """Finished prompts leave the batch (and the KV cache); the others sample exactly what they would
    with every prompt still decoding."""
    m = _model()
    prompts = [[5, 9, 11, 3, 7, 8], [4, 2], [7, 7, 1], [9]]
    free = generate(
        m, prompts, SamplingOptions(max_new_tokens=8, temperature=1.0, seed=5), use_cache=use_cache
    )
    assert all(len(o) == 8 for o in free)
    stop_after = {0: 1, 2: 4}  # prompt -> tokens it keeps
    kept = {row: 0 for row in stop_after}

    def stop(row: int, token: int) -> bool:
        if row not in stop_after:
            return False
        kept[row] += 1
        return kept[row] >= stop_after[row]

    cut = generate(
        m,
        prompts,
        SamplingOptions(max_new_tokens=8, temperature=1.0, seed=5),
        use_cache=use_cache,
        on_token=stop,
    )
    assert [len(o) for o in cut] == [1, 8, 4, 8]
    assert cut[1] == free[1] and cut[3] == free[3]
    assert cut[0] == free[0][:1] and cut[2] == free[2][:4]


def test_sampling_all_rows_at_once_draws_what_rng_choice_row_by_row_draws():
    source = np.random.default_rng(0)
    mine, ref = np.random.default_rng(7), np.random.default_rng(7)
    for step in range(60):  # one generator through the steps, as generate() uses it
        logits = (source.standard_normal((17, 300)) * source.uniform(0.5, 8)).astype(np.float32)
        temperature, top_p = (1.0, 0.7, 1.3)[step % 3], (1.0, 0.9, 0.5, 0.0)[step % 4]
        got = sample_next(logits, temperature, top_p, mine)
        np.testing.assert_array_equal(got, _sample_row_by_row(logits, temperature, top_p, ref))


def test_cached_logits_equal_full_forward():
    from bmtrain_cli.models.blocks import KVCache

    m = _model()
    m.eval()
    ids = paddle.to_tensor([[5, 9, 11, 3, 7, 8, 1, 2]])
    full = m(ids).numpy()
    cache = KVCache(len(m.layers))
    parts = [m(ids[:, :5], cache=cache).numpy()]
    for t in range(5, 8):
        parts.append(m(ids[:, t : t + 1], cache=cache).numpy())
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, atol=2e-5)


def test_decoding_stops_where_the_positions_end():
    """A huge max_new_tokens (eval --max_new_tokens 10**22) ends where the longest prompt fills
    max_position_embeddings, in generate and in the evaluation's greedy completion (which drops the eos)."""
    from bmtrain_cli.train.evaluation.answer_accuracy import greedy_complete

    m = _model(replace(TINY, max_position_embeddings=12))
    prompts = [[5, 9, 11, 3, 7, 8], [4, 2]]
    outs = generate(m, prompts, SamplingOptions(max_new_tokens=10**22))
    assert [len(o) for o in outs] == [6, 6]
    assert greedy_complete(m, prompts, max_new_tokens=10**22, eos_id=None) == outs
    assert [len(o) for o in greedy_complete(m, prompts[1:], max_new_tokens=10**22, eos_id=None)] == [10]
    eos = outs[0][2]
    got = greedy_complete(m, prompts[:1], max_new_tokens=10**22, eos_id=eos)
    assert got == [outs[0][: outs[0].index(eos)]]
    assert greedy_complete(m, [list(range(1, 13))], max_new_tokens=5, eos_id=None) == [[]]


def test_eos_stops_and_sampling_rules():
    m = _model()
    greedy = generate(m, [[5, 9, 11]], SamplingOptions(max_new_tokens=6))[0]
    stop = generate(m, [[5, 9, 11]], SamplingOptions(max_new_tokens=6, eos_token_id=greedy[2]))[0]
    assert stop == greedy[: greedy.index(greedy[2]) + 1]
    rng = np.random.default_rng(0)
    logits = np.array([[0.0, 5.0, 1.0, 4.9]])
    assert sample_next(logits, 0.0, 1.0, rng)[0] == 1
    # top_p smaller than the top token's mass: always the top token
    assert {int(sample_next(logits, 1.0, 0.1, rng)[0]) for _ in range(50)} == {1}
    # top_p covering the two large ones: only those two appear
    seen = {int(sample_next(logits, 1.0, 0.95, rng)[0]) for _ in range(200)}
    assert seen == {1, 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    d = tmp_path_factory.mktemp("model")
    texts = [f"{a} + {b} = {a + b}" for a in range(30) for b in range(30)] + ["hello world"] * 10
    tok = train_sentencepiece(texts, str(d), vocab_size=300)
    paddle.seed(0)
    m = build(replace(TINY, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id))
    save_pretrained(m, d)
    return d


def test_generate_command(model_dir):
    r = CliRunner().invoke(
        app, ["generate", "--model_path", str(model_dir), "--prompt", "1 + 2 =", "--max_new_tokens", "5"]
    )
    assert r.exit_code == 0, r.output
    again = CliRunner().invoke(
        app, ["generate", "--model_path", str(model_dir), "--prompt", "1 + 2 =", "--max_new_tokens", "5"]
    )
    assert again.stdout == r.stdout  # greedy is deterministic
    r = CliRunner().invoke(
        app,
        [
            "generate",
            "--model_path",
            str(model_dir),
            "--prompt",
            "hi",
            "--chat",
            "--temperature",
            "0.8",
            "--top_p",
            "0.9",
            "--max_new_tokens",
            "4",
        ],
    )
    assert r.exit_code == 0, r.output


def test_eval_command(model_dir, tmp_path):
    from bmtrain_cli.data.tokenizers import load_tokenizer

    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"input": "1 + 2 =", "output": " 3"}) + "\n" + json.dumps({"text": "hello world"}) + "\n"
    )
    r = CliRunner().invoke(app, ["eval", "--model_path", str(model_dir), "--data_path", str(data), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["records"] == 2 and out["tokens"] > 0
    assert math.isclose(out["ppl"], math.exp(out["loss"]), rel_tol=1e-9)
    # the same number by hand: answer tokens (+ eos) of the instruction, every token of the text
    tok = load_tokenizer(str(model_dir))
    m = load_pretrained(model_dir)
    ans = tok.encode(" 3") + [tok.eos_id]
    text = tok.encode("hello world") + [tok.eos_id]
    assert out["tokens"] == len(ans) + len(text)
    total = 0.0
    for prompt_ids, scored in ((tok.encode("1 + 2 ="), ans), ([], text)):
        ids = [tok.bos_id, *prompt_ids, *scored]
        logits = m(paddle.to_tensor([ids])).numpy()[0].astype(np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        start = len(ids) - len(scored)
        total -= sum(logp[t - 1, ids[t]] for t in range(start, len(ids)))
    assert math.isclose(out["loss"], total / out["tokens"], rel_tol=1e-4)
    # exact match over the one record with a reference answer: the greedy answer, decoded, equals " 3"?
    from bmtrain_cli.train.evaluation.answer_accuracy import greedy_complete

    (got,) = greedy_complete(m, [[tok.bos_id, *tok.encode("1 + 2 =")]], max_new_tokens=32, eos_id=tok.eos_id)
    assert out["exact_match_records"] == 1
    assert out["exact_match"] == float(tok.decode(got).strip() == "3")
    r = CliRunner().invoke(app, ["eval", "--model_path", str(model_dir), "--data_path", str(data)])
    assert r.exit_code == 0 and "ppl" in r.stdout and "exact match" in r.stdout and "of 1" in r.stdout
    args = ["eval", "--model_path", str(model_dir), "--data_path", str(data), "--json", "--no_exact_match"]
    r = CliRunner().invoke(app, args)
    assert "exact_match" not in json.loads(r.stdout.strip().splitlines()[-1])


def test_command_errors(model_dir, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["generate", "--model_path", str(tmp_path / "nope"), "--prompt", "x"])
    assert r.exit_code == 2 and "does not exist" in r.output
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((model_dir / f).read_bytes())
    r = runner.invoke(app, ["generate", "--model_path", str(bare), "--prompt", "x"])
    assert r.exit_code == 2 and "tokenizer" in r.output and "Traceback" not in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "output": "b"}\n{"oops": 1}\n')
    r = runner.invoke(app, ["eval", "--model_path", str(model_dir), "--data_path", str(bad)])
    assert r.exit_code == 2 and "bad.jsonl:2" in r.output
    r = runner.invoke(
        app, ["eval", "--model_path", str(model_dir), "--data_path", str(tmp_path / "none.jsonl")]
    )
    assert r.exit_code == 2


def test_half_precision_on_cpu_is_a_clear_error(model_dir):
    from bmtrain_cli.machine import paddle_has_gpu

    if paddle_has_gpu(import_paddle=True):
        pytest.skip("a GPU is present: half precision is allowed")
    r = CliRunner().invoke(
        app, ["generate", "--model_path", str(model_dir), "--prompt", "x", "--dtype", "bfloat16"]
    )
    assert r.exit_code == 2 and "needs a GPU" in r.output and "Traceback" not in r.output


def test_exact_match_stops_hopeless_answers_early_with_the_same_accuracy(model_dir):
    """answer_accuracy stops a record's decoding once its text cannot become the answer; the accuracy
    equals the one from decoding every record to the end."""
    from bmtrain_cli.data.encode import encode_prompt
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.train.evaluation.answer_accuracy import answer_accuracy, greedy_complete

    tok, m = load_tokenizer(str(model_dir)), load_pretrained(model_dir)
    inputs = [f"{a} + {a} =" for a in range(8)]
    prompts = [encode_prompt({"input": x, "output": "-"}, tok, "auto", "auto")[0] for x in inputs]
    full = [tok.decode(o).strip() for o in greedy_complete(m, prompts, max_new_tokens=12, eos_id=tok.eos_id)]
    assert all(len(f) > 2 for f in full)
    # the model's own answer (matches), the same with a late change, and a different first character
    outputs = [f if i % 3 == 0 else f[:-1] + "#" if i % 3 == 1 else "#" + f for i, f in enumerate(full)]
    records = [{"input": x, "output": y} for x, y in zip(inputs, outputs)]
    acc = answer_accuracy(m, tok, records, max_new_tokens=12)
    assert acc["n"] == 8 and acc["accuracy"] == sum(i % 3 == 0 for i in range(8)) / 8
    assert [e["got"] for e in acc["examples"]][::3] == full[:5][::3]
    assert all(full[i].startswith(e["got"]) for i, e in enumerate(acc["examples"]))


@pytest.mark.parametrize("use_cache", [True, False])
def test_decoding_in_step_with_an_expert_group_runs_every_step_and_samples_the_same(use_cache):
    """Under expert parallel (``decode_in_step``, parallel/expert_parallel.py) a rank whose rows are done
    keeps running one forward per step (dropped) until every rank of its group is done, and samples exactly
    what it samples alone; the loop asks the group once per step, with this rank's done flag."""
    m = _model(replace(TINY, max_position_embeddings=12))
    prompts = [[5, 9, 11, 3], [4, 2]]
    options = SamplingOptions(max_new_tokens=5, temperature=1.0, seed=5)
    alone = generate(m, prompts, options, use_cache=use_cache)
    short = generate(m, prompts, replace(options, max_new_tokens=10**6), use_cache=use_cache)
    assert [len(o) for o in short] == [8, 8]  # ends where the positions end
    forwards: list = []
    real = m.hidden_states
    m.hidden_states = lambda *a, **k: forwards.append(a[0].shape) or real(*a, **k)  # type: ignore
    flags: list = []

    def group_done(done: bool) -> bool:  # another rank of the group decodes 11 steps
        flags.append(done)
        return len(flags) > 11

    m.decode_in_step = group_done
    for opts, want in ((options, alone), (replace(options, max_new_tokens=10**6), short)):
        flags.clear()
        forwards.clear()
        assert generate(m, prompts, opts, use_cache=use_cache) == want
        n = len(want[0])
        assert flags == [False] * n + [True] * (12 - n)  # asked once per step, then the group's end
        assert len(forwards) == 11 and all(s == [1, 1] for s in forwards[n:])  # the idle steps: one token
