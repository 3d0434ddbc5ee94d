"""Hostile inputs that must stay within bounds (issue 28): chat templates that loop, recurse or build huge
strings; records far longer than max_seq_len; damaged compressed data. Each ends in exit 2 with one line
naming the file, in seconds and without a large allocation. docs/training.md ("Guarantees") states what
these check."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
from typer.testing import CliRunner

from bmtrain_cli.cli import app
from bmtrain_cli.data import templates
from bmtrain_cli.data.formats import Conversation
from bmtrain_cli.data.templates import JinjaTemplate
from bmtrain_cli.errors import UserError
from tests.robustness import assert_clean_exit, run_config
from tests.tree import tree_digest

# ----------------------------------------------------------------------------- hostile chat templates

# (name, template, what the error says): the cases and variants of each class
HOSTILE_TEMPLATES = [
    (
        "nested range loops",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "loop",
    ),
    (
        "nested loops printing",
        "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",
        "",
    ),
    (
        "loops over a built string",
        "{% set s = 'ab' * 4000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "loop",
    ),
    (
        "captured loop output",
        "{% set x %}{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}{% endset %}{{ x }}",
        "loop",
    ),
    ("string times 10**10", "{{ 'x' * 10**10 }}", "'*'"),
    ("list times 10**9", "{{ ([1] * 10**9) | length }}", "'*'"),
    ("range(10**9)", "{{ range(10**9) | length }}", "range()"),
    ("range over the item limit", "{{ range(200000) | length }}", "range()"),
    ("infinite macro recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nested deeper"),
    (
        "mutual recursion",
        "{% macro a() %}{{ b() }}{% endmacro %}{% macro b() %}{{ a() }}{% endmacro %}{{ a() }}",
        "nested",
    ),
    (
        "doubling with ~",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "'~'",
    ),
    (
        "doubling with +",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "'+'",
    ),
    ("center filter", "{{ 'x' | center(10**10) }}", "center"),
    ("ljust method", "{{ 'x'.ljust(10**10) }}", "ljust"),
    ("percent width", "{{ '%*d' % (10**10, 1) }}", "'%'"),
    ("huge power", "{{ 2 ** (10 ** 9) }}", "**"),
    ("output over the limit", "{% for i in range(90000) %}{{ 'y' * 1000 }}{% endfor %}", "characters"),
    ("raises", "{{ raise_exception('no system role') }}", "no system role"),
    ("type error", "{{ messages + 1 }}", "failed"),
]


def _conv() -> Conversation:
    return Conversation(system=None, messages=[("user", "1+1="), ("assistant", "2")])


@pytest.mark.parametrize("name, source, says", HOSTILE_TEMPLATES, ids=[c[0] for c in HOSTILE_TEMPLATES])
def test_a_hostile_template_stops_within_its_limits(name, source, says):
    t0 = time.monotonic()
    with pytest.raises(UserError) as err:
        JinjaTemplate(source, "model/chat_template.jinja").render(_conv())
    took = time.monotonic() - t0
    msg = str(err.value)
    assert msg.startswith("model/chat_template.jinja: the chat template"), msg
    assert says in msg and "\n" not in msg, msg
    assert took < templates.MAX_RENDER_SECONDS, f"{name}: {took:.1f} s"


def test_the_time_limit_stops_a_slow_render(monkeypatch):
    """Loops under the step limit that still take long (each step slow) end at the wall-clock limit."""
    monkeypatch.setattr(templates, "MAX_RENDER_SECONDS", 0.2)
    src = "{% for i in range(99999) %}{% for j in range(9) %}{{ ('%05d' % j) | replace('0', 'ab') }}{% endfor %}{% endfor %}"
    t0 = time.monotonic()
    with pytest.raises(UserError, match="ran longer than 0.2 s"):
        JinjaTemplate(src, "t.jinja").render(_conv())
    assert time.monotonic() - t0 < 2


def test_an_ordinary_template_renders_under_the_limits():
    src = (
        "{% for m in messages %}{% if loop.first and m.role != 'system' %}<s>sys</s>{% endif %}"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    long = Conversation(system=None, messages=[("user", "q" * 100000), ("assistant", "a" * 100000)] * 20)
    pieces = JinjaTemplate(src).render(long)
    assert "".join(p for p, _ in pieces).count("<assistant>") == 20
    assert [p for p, trained in pieces if trained][0] == "a" * 100000 + "</assistant>"


def _tokenizer_with(ws: Path, source: str) -> Path:
    tok = ws / "hostile-tok"
    if tok.exists():
        shutil.rmtree(tok)
    shutil.copytree(ws / "run" / "tokenizer", tok)
    cfg = tok / "tokenizer_config.json"
    settings = json.loads(cfg.read_text(encoding="utf-8"))
    settings.pop("chat_template", None)
    cfg.write_text(json.dumps(settings), encoding="utf-8")
    (tok / "chat_template.jinja").write_text(source, encoding="utf-8")
    return tok


CLI_TEMPLATES = [
    c
    for c in HOSTILE_TEMPLATES
    if c[0] in ("nested range loops", "string times 10**10", "range(10**9)", "infinite macro recursion")
]


@pytest.fixture(scope="module")
def bounds_ws(robust_run, tmp_path_factory) -> Path:
    tmp, out, data = robust_run
    ws = tmp_path_factory.mktemp("bounds")
    shutil.copytree(out, ws / "run")
    shutil.copy(data, ws / "data.jsonl")
    return ws


@pytest.mark.parametrize("name, source, says", CLI_TEMPLATES, ids=[c[0] for c in CLI_TEMPLATES])
def test_a_hostile_template_is_one_line_through_the_commands(bounds_ws, name, source, says):
    """`generate --chat`, `data-stats` and `train` with the tokenizer's chat template hostile: exit 2 with
    one line naming chat_template.jinja; nothing outside the new output changes."""
    ws = bounds_ws
    tok = _tokenizer_with(ws, source)
    cfg = run_config(ws, ws / "out-hostile", ws / "data.jsonl", 1)
    text = (
        Path(cfg)
        .read_text(encoding="utf-8")
        .replace("model_config:\n", f"model_config:\n  tokenizer_path: {tok}\n", 1)
    )
    text = text.replace("train_config:\n", "train_config:\n  template: tokenizer\n", 1)
    Path(cfg).write_text(text, encoding="utf-8")
    before = tree_digest(ws / "run")
    for args in (
        [
            "generate",
            "--model_path",
            str(ws / "run/checkpoints/step-2"),
            "--tokenizer_path",
            str(tok),
            "--chat",
            "--prompt",
            "1+1=",
            "--max_new_tokens",
            "1",
        ],
        ["data-stats", "--config", cfg],
        ["train", "--config", cfg, "--overwrite"],
    ):
        t0 = time.monotonic()
        res = CliRunner().invoke(app, args)
        assert_clean_exit(res, f"{args[0]} {name}")
        assert res.exit_code == 2 and "chat_template.jinja: the chat template" in res.output, res.output
        assert says in res.output, res.output
        assert time.monotonic() - t0 < 60
    assert tree_digest(ws / "run") == before


# ----------------------------------------------------------------------------- memory plans over the machine


def test_a_plan_over_the_memory_is_refused_unless_overcommit_is_allowed(tmp_path):
    from bmtrain_cli.config.load import load_config
    from bmtrain_cli.plan.devices import get_device
    from bmtrain_cli.plan.estimator import check_memory_fits, training_estimate

    path = tmp_path / "big.yaml"
    path.write_text(
        BIG_MODEL.format(layers=32, out=tmp_path / "out", data=tmp_path / "d.jsonl"), encoding="utf-8"
    )
    cfg = load_config(str(path)).config
    plan = training_estimate(cfg, device=get_device("RTX4090"))
    with pytest.raises(UserError, match="refused before allocating.*allow_memory_overcommit: true"):
        check_memory_fits(plan, allow_overcommit=False)
    assert "warning: the memory plan" in check_memory_fits(plan, allow_overcommit=True)
    path.write_text(
        BIG_MODEL.format(layers=2, out=tmp_path / "out", data=tmp_path / "d.jsonl"), encoding="utf-8"
    )
    small = training_estimate(load_config(str(path)).config, device=get_device("A100-80GB"))
    assert check_memory_fits(small, allow_overcommit=False) is None


BIG_MODEL = """model_config:
  family: llama
  hidden_size: 4096
  intermediate_size: 11008
  num_hidden_layers: {layers}
  num_attention_heads: 32
  max_seq_len: 1024
train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: 1
  micro_batch_size: 8
  num_workers: 0
"""


def test_train_refuses_a_fresh_model_whose_plan_exceeds_the_ram(tmp_path):
    """A fresh model whose weights fit in RAM (about 0.4 of it) but whose plan (weights, gradients, Adam
    moments, activations) does not: refused in seconds before the model is built (it allocated 11 GB in
    200 s before); no run files written."""
    from bmtrain_cli.plan.devices import host_memory_bytes

    ram = host_memory_bytes()
    if not ram:
        pytest.skip("host memory unknown")
    layers = max(1, int(0.4 * ram / (0.81 * 2**30)))  # ~202M fp32 parameters a layer
    from tests.robustness import write_arithmetic

    data = write_arithmetic(tmp_path / "d.jsonl")
    cfg = tmp_path / "big.yaml"
    cfg.write_text(BIG_MODEL.format(layers=layers, out=tmp_path / "out", data=data), encoding="utf-8")
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert_clean_exit(res, "train big")
    assert res.exit_code == 2 and "allow_memory_overcommit" in res.output, res.output
    assert time.monotonic() - t0 < 60
    out = tmp_path / "out"  # only the generated tokenizer (made before the plan can be sized) is there
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


# ----------------------------------------------------------------------------- no process outlives its run


def _children(pid: int) -> List[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        frontier += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_no_data_worker_outlives_a_killed_trainer(tmp_path, sig):
    """A streaming `bmtrain train` with two forked data workers, killed mid-stream (SIGKILL, or SIGTERM /
    SIGINT, which stop it gracefully): every process it started is gone within 5 s of the trainer's end
    (a worker stayed forever blocked in a queue put, with parent pid 1)."""
    from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data
    from tests.integration.test_stream_kill_resume import CONFIG, _last_step

    train, heldout = write_demo_data(str(tmp_path), task="arithmetic", seed=0)
    train_demo_tokenizer(str(tmp_path / "tok"), [train, heldout])
    out = tmp_path / "run"
    cfg = tmp_path / "stream.yaml"
    text = CONFIG.format(tok=tmp_path / "tok", data=train, workers=2, on_bad="error", out=out)
    cfg.write_text(text.replace("max_steps: 12", "max_steps: 400"), encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while proc.poll() is None and _last_step(out) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the run ended before it could be killed"
        kids = _children(proc.pid)
        assert len(kids) >= 2, kids  # the data workers
        os.kill(proc.pid, sig)
        proc.wait(timeout=120)
        deadline = time.time() + 5
        while any(_alive(k) for k in kids) and time.time() < deadline:
            time.sleep(0.1)
        assert [k for k in kids if _alive(k)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
        for k in _children(proc.pid):
            os.kill(k, signal.SIGKILL)


# ----------------------------------------------------------------------------- huge and damaged data files


def _records(n: int = 40) -> bytes:
    return "".join(json.dumps({"input": f"{i}+{i}=", "output": str(2 * i)}) + "\n" for i in range(n)).encode()


def _gz_cases(tmp: Path):
    import gzip

    gz = gzip.compress(_records())
    flipped = bytearray(gz)
    for k in range(len(gz) // 3, len(gz) // 3 + 8):
        flipped[k] ^= 0xA5
    yield "truncated.jsonl.gz", gz[: len(gz) // 2], "truncated"
    yield "truncated-header.jsonl.gz", gz[:6], "truncated"
    yield "corrupt.jsonl.gz", bytes(flipped), "corrupt compressed data"
    yield "not-gzip.jsonl.gz", _records(), "corrupt compressed data"
    try:
        import zstandard
    except ImportError:
        return
    zs = zstandard.ZstdCompressor().compress(_records())
    yield "corrupt.jsonl.zst", zs[:8] + bytes(64) + zs[72:], "corrupt compressed data"


def test_damaged_compressed_data_is_one_line_naming_the_file(bounds_ws, tmp_path):
    """A truncated .jsonl.gz printed only `Aborted.`; corrupt bytes gave a zlib.error traceback."""
    cfg = run_config(tmp_path, tmp_path / "out", tmp_path / "x.jsonl", 1)
    text = (
        Path(cfg)
        .read_text(encoding="utf-8")
        .replace("model_config:\n", f"model_config:\n  tokenizer_path: {bounds_ws / 'run/tokenizer'}\n", 1)
    )
    Path(cfg).write_text(text, encoding="utf-8")
    for name, content, says in _gz_cases(tmp_path):
        (tmp_path / name).write_bytes(content)
        for extra in ([], ["--set", "train_config.streaming=true"]):
            args = ["data-stats", "--config", cfg, "--data_path", str(tmp_path / name), *extra]
            res = CliRunner().invoke(app, args)
            assert_clean_exit(res, f"{name} {extra}")
            assert res.exit_code == 2 and f"{name}: {says}" in res.output, f"{name} {extra}: {res.output}"


HUGE_RECORD = """
import json, sys
from bmtrain_cli.data.readers import raw_records, read_records, line_limit
from bmtrain_cli.data.stream_reader import RecordStream
path, mode = sys.argv[1], sys.argv[2]
if mode == "stream":
    s = RecordStream([[path]], None, 0, limit=line_limit(512))
    got = [s.readers[0].next() for _ in range(41)]
    bad = [g for g in got if g and len(g[2]) == 0]
    print(json.dumps({"bad_lines": [g[1] for g in bad]}))
else:
    recs = list(read_records(path, line_limit(512)))
    print(json.dumps({"bad_lines": [r.line for r in recs if r.error], "reason": [r.error for r in recs if r.error]}))
# VmHWM is this program's own peak (ru_maxrss would carry the forking parent's across exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(json.dumps({"maxrss_mb": int(hwm) // 1024}))
"""


@pytest.mark.parametrize("mode", ["records", "stream"])
def test_a_200_mb_record_is_rejected_without_reading_it_whole(tmp_path, mode):
    """A 200 MB single JSONL line took over 7 GB to tokenise, then std::bad_alloc: it is a bad record
    (over line_limit(max_seq_len) bytes) read a block at a time, and peak memory stays far below its size."""
    path = tmp_path / "huge.jsonl"
    recs = _records(40).splitlines(keepends=True)
    with open(path, "wb") as f:
        f.writelines(recs[:20])
        f.write(b'{"input": "1+1=", "output": "')
        block = b"x" * 2**20
        for _ in range(200):
            f.write(block)
        f.write(b'"}\n')
        f.writelines(recs[20:])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    res = subprocess.run(
        [sys.executable, "-c", HUGE_RECORD, str(path), mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    first, second = (json.loads(x) for x in res.stdout.splitlines())
    assert first["bad_lines"] == [21], first
    assert second["maxrss_mb"] < 100, second


# ----------------------------------------------------------------------------- hostile model directories


@pytest.mark.parametrize("vocab", [10**12, 1e12, 2**40])
def test_a_huge_vocab_size_is_refused_by_generate_and_eval_as_by_train(bounds_ws, tmp_path, vocab):
    """config.json with vocab_size 1e12: `generate` and `eval` ended in Paddle's MemoryError; they refuse it
    by train's rule (the weights alone exceed the memory), in one line."""
    model = tmp_path / "model"
    shutil.copytree(bounds_ws / "run/checkpoints/step-2", model)
    cfg = json.loads((model / "config.json").read_text(encoding="utf-8"))
    cfg["vocab_size"] = vocab
    (model / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    before = tree_digest(tmp_path)
    for args in (
        ["generate", "--model_path", str(model), "--prompt", "1+1=", "--max_new_tokens", "1"],
        ["eval", "--model_path", str(model), "--data_path", str(bounds_ws / "data.jsonl")],
    ):
        res = CliRunner().invoke(app, args)
        assert_clean_exit(res, f"{args[0]} vocab {vocab}")
        assert res.exit_code == 2, res.output
        assert "weights alone need" in res.output or "vocab_size" in res.output, res.output
    assert tree_digest(tmp_path) == before


def test_a_safetensors_shape_that_disagrees_with_its_bytes_is_one_line(bounds_ws, tmp_path):
    """A header whose shape disagrees with its byte range gave `cannot reshape` tracebacks."""
    model = tmp_path / "model"
    shutil.copytree(bounds_ws / "run/checkpoints/step-2", model)
    st = model / "model.safetensors"
    data = st.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    header[name]["shape"] = [header[name]["shape"][0] + 1, header[name]["shape"][1]]
    text = json.dumps(header).encode()  # offsets count from the header's end: a new length is fine
    st.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    for args in (
        ["generate", "--model_path", str(model), "--prompt", "1+1=", "--max_new_tokens", "1"],
        ["eval", "--model_path", str(model), "--data_path", str(bounds_ws / "data.jsonl")],
    ):
        res = CliRunner().invoke(app, args)
        assert_clean_exit(res, f"{args[0]} reshape")
        assert res.exit_code == 2 and "damaged safetensors header" in res.output and name in res.output, (
            res.output
        )
