"""`bmtrain serve` under concurrent clients against transformers' batched `generate`, in one run.

The model: the SmolLM2-135M shape (30 layers, hidden 576, 9 / 3 heads, ffn 1536, vocab 49152, tied
embeddings), random weights (seed 0), written by ``models.save_pretrained`` (Hugging Face config.json +
model.safetensors) with a byte-level BPE tokenizer.json of the full 49152 ids (the SmolLM2 test
tokenizer of tests/fixtures/chat_parity/smollm2, extended with seeded merges), so every id the random
model picks decodes to text. Both stacks load that same directory.

- serve: a real `bmtrain serve` process; 1, 8 and 32 concurrent clients, each sending streamed
  /v1/completions requests (greedy, ``max_tokens`` NEW tokens, usage in the last event) for a bounded
  number of requests; aggregate completion tokens/s (all tokens / wall time from the first request to the
  last answer) and time to first token (request sent -> first text chunk; median and worst). With a
  baseline, both servers run at once and the rounds alternate between them; each level reports its
  median round.
- transformers: ``LlamaForCausalLM.generate`` (greedy, exactly NEW tokens) on the first 8 prompts' ids
  as one left-padded batch of 8, in the reference venv (/work/main/.venv-ref or $BENCH_TORCH_PYTHON);
  best of the timed rounds after one warm-up.

Both run with the same OMP_NUM_THREADS (default 2). Ratios: 8 clients / 1 client, 8 clients / transformers.
``--baseline DIR`` measures a second `bmtrain serve` from another checkout's root in the same run (e.g. an
earlier commit: ``git archive COMMIT bmtrain_cli | tar -x -C DIR``).

    OMP_NUM_THREADS=2 python benchmarks/bench_serve.py [--new 32] [--rounds 1] [--clients 1,8,32]
        [--baseline DIR] [--baseline-clients 1,8]
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SMOLLM2_TOKENIZER = REPO / "tests" / "fixtures" / "chat_parity" / "smollm2"
SHAPE = dict(layers=30, hidden=576, heads=9, kv_heads=3, ffn=1536, vocab=49152)
CLIENTS = {1: 4, 8: 2, 32: 1}  # concurrent clients -> requests each
WORDS = "the model reads a prompt and writes a reply one token at a time while other clients wait".split()


# ---------------------------------------------------------------- the model directory
def _tokenizer_json(vocab_size: int, seed: int = 0) -> Dict[str, Any]:
    """SmolLM2's test tokenizer (its specials within the vocabulary) grown to ``vocab_size`` ids by seeded
    merges of its own tokens."""
    import random

    data = json.loads((SMOLLM2_TOKENIZER / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: Dict[str, int] = data["model"]["vocab"]
    merges: List[List[str]] = data["model"]["merges"]
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in vocab]  # ids of their own
    special = {t["content"] for t in data["added_tokens"]}
    # merges of printable ASCII pieces only ("Ġ" is byte-level's space): every new id decodes to whole
    # characters, so a random model's reply streams at once instead of waiting for UTF-8 to complete
    pieces = [t for t in vocab if t not in special and all(c == "Ġ" or "!" <= c <= "~" for c in t)]
    rng = random.Random(seed)
    nxt = max(vocab.values()) + 1
    while nxt < vocab_size:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if a + b in vocab or len(a + b) > 12:
            continue
        vocab[a + b] = nxt
        merges.append([a, b])
        pieces.append(a + b)
        nxt += 1
    return data


def make_model(out: Path) -> Path:
    """The SmolLM2-135M-shaped model directory (see the module docstring)."""
    from dataclasses import replace

    import paddle

    from bmtrain_cli.models import build, save_pretrained
    from bmtrain_cli.models.arch import ModelArch

    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json(SHAPE["vocab"])), encoding="utf-8")
    config = json.loads((SMOLLM2_TOKENIZER / "tokenizer_config.json").read_text(encoding="utf-8"))
    (out / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    arch = ModelArch(
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["ffn"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["hidden"] // SHAPE["heads"],
        vocab_size=SHAPE["vocab"],
        max_position_embeddings=2048,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    arch = replace(arch, bos_token_id=0, eos_token_id=2, pad_token_id=0)
    paddle.seed(0)
    save_pretrained(build(arch, kernels="reference"), out)
    return out


def prompts(n: int) -> List[str]:
    """``n`` different prompts of 16 to 23 words."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(16 + i % 8)) for i in range(n)]


# ---------------------------------------------------------------- the server side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: Path, new: int, repo: Path = REPO) -> Tuple[subprocess.Popen, str]:
    """`bmtrain serve` of ``repo``'s bmtrain_cli on a free loopback port; (process, its address)."""
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    env.setdefault("OMP_NUM_THREADS", "2")
    cmd = [sys.executable, "-m", "bmtrain_cli", "serve", "--model_path", str(model), "--port", str(port)]
    cmd += ["--max-batch", "32", "--max-queue", "64", "--max-tokens", str(new)]
    log = model.parent / f"serve-{port}.log"
    with open(log, "w") as out:
        # run from the repo root: `python -m` puts the working directory ahead of PYTHONPATH
        proc = subprocess.Popen(cmd, env=env, cwd=str(repo), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"bmtrain serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("bmtrain serve did not answer /health within 300 s")


def _one(url: str, prompt: str, new: int) -> Tuple[float, int]:
    """One streamed greedy completion: (seconds to the first text chunk, completion tokens)."""
    import httpx

    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first: Optional[float] = None
    tokens = -1
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
    if first is None or tokens < 0:
        raise RuntimeError(f"a reply without text or usage (first {first}, tokens {tokens})")
    return first, tokens


def load(url: str, clients: int, each: int, new: int) -> Dict[str, float]:
    """``clients`` threads, each sending ``each`` requests one after another."""
    texts = prompts(clients)
    ttfts: List[float] = []
    tokens: List[int] = []
    errors: List[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        try:
            for _ in range(each):
                ttft, n = _one(url, texts[i], new)
                with lock:
                    ttfts.append(ttft)
                    tokens.append(n)
        except BaseException as exc:  # reported below: a lost request fails the benchmark
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}")
    return {
        "clients": clients,
        "requests": len(tokens),
        "tokens": sum(tokens),
        "wall_s": wall,
        "tokens_per_s": sum(tokens) / wall,
        "ttft_median_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
    }


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------- transformers (reference venv)
TORCH_WORKER = r"""
import json, sys, time
import torch
from transformers import AutoModelForCausalLM
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
ids = args["ids"]
width = max(len(p) for p in ids)
inp = torch.tensor([[0] * (width - len(p)) + p for p in ids])
mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
times = []
with torch.no_grad():
    for r in range(args["rounds"] + 1):
        t0 = time.perf_counter()
        out = model.generate(input_ids=inp, attention_mask=mask, max_new_tokens=args["new"],
                             min_new_tokens=args["new"], do_sample=False, pad_token_id=0)
        if r:
            times.append(time.perf_counter() - t0)
tokens = (out.shape[1] - width) * len(ids)
print(json.dumps({"tokens": tokens, "best_s": min(times), "tokens_per_s": tokens / min(times)}))
"""


def _torch_python() -> Optional[str]:
    for cand in (os.environ.get("BENCH_TORCH_PYTHON"), "/work/main/.venv-ref/bin/python"):
        if cand and Path(cand).exists():
            return cand
    return None


def transformers_generate(
    model: Path, ids: List[List[int]], new: int, rounds: int
) -> Optional[Dict[str, Any]]:
    python = _torch_python()
    if python is None:
        print("no reference venv with torch + transformers (make ref-venv, or set BENCH_TORCH_PYTHON)")
        return None
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    args = json.dumps({"model": str(model), "ids": ids, "new": new, "rounds": rounds, "threads": threads})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([python, "-c", TORCH_WORKER, args], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"transformers worker failed: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------- main
def _median_round(results: List[Dict[str, float]]) -> Dict[str, Any]:
    """The round with the median tokens/s (the lower middle one of an even count)."""
    ranked = sorted(results, key=lambda r: r["tokens_per_s"])
    return {**ranked[(len(ranked) - 1) // 2], "rounds_tokens_per_s": [r["tokens_per_s"] for r in results]}


def _serve_rounds(
    model: Path, new: int, rounds: int, stacks: Dict[str, Tuple[Path, Sequence[int]]]
) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """Every stack's server started at once (an idle one takes no CPU), then ``rounds`` rounds, each
    running every stack's levels in turn, so load on a shared machine hits all of them alike."""
    servers = {}
    try:
        for name, (repo, _) in stacks.items():
            servers[name] = start_server(model, new, repo)
            _one(servers[name][1], prompts(1)[0], new)  # warm-up
        runs: Dict[str, Dict[int, List[Dict[str, float]]]] = {
            n: {c: [] for c in lv} for n, (_, lv) in stacks.items()
        }
        for r in range(rounds):
            for name, (_, levels) in stacks.items():
                for c in levels:
                    res = load(servers[name][1], c, CLIENTS.get(c, 1), new)
                    runs[name][c].append(res)
                    print(
                        f"round {r + 1} {name:>14} {c:>3} clients: {res['tokens_per_s']:7.1f} tokens/s, "
                        f"TTFT median {res['ttft_median_s']:.2f}s, max {res['ttft_max_s']:.2f}s",
                        flush=True,
                    )
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return {n: {c: _median_round(rs) for c, rs in per.items()} for n, per in runs.items()}


def main(
    new: int = 32,
    rounds: int = 1,
    clients: Sequence[int] = (1, 8, 32),
    baseline: Optional[str] = None,
    baseline_clients: Optional[Sequence[int]] = None,
) -> Dict[str, Any]:
    """``baseline``: another checkout's root (e.g. `git archive` of an earlier commit) whose `bmtrain
    serve` is measured in the same run, after this one's, at ``baseline_clients`` (default: ``clients``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from bmtrain_cli.data.tokenizers import load_tokenizer

    result: Dict[str, Any] = {"new_tokens": new, "threads": os.environ["OMP_NUM_THREADS"]}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "smollm2-135m-shape")
        tok = load_tokenizer(str(model))
        ref = transformers_generate(model, [tok.encode(p) for p in prompts(8)], new, rounds)
        if ref is not None:
            result["transformers_batch8"] = ref
            print(
                f"transformers generate, batch 8, {new} new tokens: {ref['tokens_per_s']:.1f} tokens/s",
                flush=True,
            )
        stacks: Dict[str, Tuple[Path, Sequence[int]]] = {"serve": (REPO, clients)}
        if baseline:
            stacks["serve_baseline"] = (Path(baseline), baseline_clients or clients)
        measured = _serve_rounds(model, new, rounds, stacks)
    for name, levels in measured.items():
        result[name] = levels
        print(f"\n{name}: SmolLM2-135M shape, greedy, {new} new tokens, median of {rounds} round(s)")
        print(f"{'clients':>8} {'requests':>9} {'tokens/s':>9} {'TTFT med':>9} {'TTFT max':>9}")
        for c, r in levels.items():
            print(
                f"{c:>8} {r['requests']:>9} {r['tokens_per_s']:>9.1f} {r['ttft_median_s']:>8.2f}s "
                f"{r['ttft_max_s']:>8.2f}s"
            )
        if 1 in levels and 8 in levels:
            result[f"{name}_x8_over_x1"] = levels[8]["tokens_per_s"] / levels[1]["tokens_per_s"]
            print(f"8 clients / 1 client: {result[f'{name}_x8_over_x1']:.2f}x")
        if ref is not None and 8 in levels:
            result[f"{name}_x8_over_transformers"] = levels[8]["tokens_per_s"] / ref["tokens_per_s"]
            print(f"8 clients / transformers batch 8: {result[f'{name}_x8_over_transformers']:.2f}x")
    return result


def _arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    out = main(
        int(_arg("--new", "32")),
        int(_arg("--rounds", "1")),
        [int(c) for c in _arg("--clients", "1,8,32").split(",")],
        _arg("--baseline", "") or None,
        [int(c) for c in _arg("--baseline-clients", "").split(",") if c] or None,
    )
    print(json.dumps(out, indent=2))
