"""Streaming mode on large generated JSONL: time to the first optimizer step, peak memory against the file
size, loader throughput against the raw tokenizer with 1 and 2 workers, and the loader's share of a step.

Run: python benchmarks/run_all.py streaming     (or: python benchmarks/bench_streaming.py)

The data is generated outside the repository, in $BENCH_STREAM_DIR (default /tmp/bmtrain-bench-stream),
at the sizes in $BENCH_STREAM_SIZES_MB (default "200,2000"); files already there are reused. Records are
instruction pairs of ~130 tokens drawn from a pool of 20,000, each made unique by its number.

Baselines measured in the same run:
  raw     tokenizer.encode_batch of prompt + answer, in memory, one process (text already decoded)
  cached  `bmtrain train` with streaming: false on a small file: everything is tokenised before step 1
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = (
    "the model learns to answer questions about data files tokens batches training loss gradient step "
    "paddle config template prompt response system user assistant sample record format cache index "
    "packing padding position attention mask segment epoch shard rank resume checkpoint stream buffer"
).split()
POOL = 20000
LOADER_RECORDS = int(os.environ.get("BENCH_STREAM_RECORDS", "30000"))  # records per loader pass
TRAIN_STEPS = 20
PASS_BUFFER = 1000  # shuffle_buffer of the throughput passes: small against the records of a pass


def _pool_tails(seed: int = 0) -> List[str]:
    """JSON lines without their opening '{"input": "' (a record number goes there)."""
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    out = []
    for _ in range(POOL):
        rec = {
            "input": sentence(rng.randint(8, 30)) + "\n" + sentence(rng.randint(0, 20)),
            "output": " ".join(sentence(rng.randint(5, 15)) for _ in range(rng.randint(2, 6))),
        }
        out.append(json.dumps(rec)[len('{"input": "') :] + "\n")
    return out


def make_file(path: Path, size_mb: int) -> Path:
    """A JSONL of about size_mb MiB (reused when there)."""
    target = size_mb << 20
    if path.exists() and abs(path.stat().st_size - target) < (1 << 20):
        return path
    tails = _pool_tails()
    tmp = path.with_suffix(".tmp")
    written, i = 0, 0
    with open(tmp, "w", encoding="utf-8") as f:
        while written < target:
            buf = [f'{{"input": "#{i + j} {tails[(i + j) % POOL]}' for j in range(10000)]
            text = "".join(buf)
            f.write(text)
            written += len(text)
            i += 10000
    tmp.replace(path)
    return path


def _pss(pid: int) -> int:
    """Proportional set size: a page shared by n processes (a forked worker and its parent) counts 1/n."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    """Resident bytes (PSS) of a process and all its descendants."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        total += _pss(p)
    return total


class PeakRSS:
    """Samples tree_rss(pid) every 0.1 s in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def _config_text(data: Path, tok: Path, out: Path, streaming: bool, workers: int) -> str:
    return f"""model_config:
  family: llama
  hidden_size: 64
  intermediate_size: 172
  num_hidden_layers: 2
  num_attention_heads: 4
  max_seq_len: 256
  kernels: reference
  tokenizer_path: {tok}
train_config:
  data_path: {data}
  template: plain
  streaming: {"true" if streaming else "false"}
  data_workers: {workers}
  data_cache_dir: {out}/cache
  batching: packed
  output_dir: {out}
  overwrite_output_dir: true
  max_steps: {TRAIN_STEPS}
  micro_batch_size: 4
  learning_rate: 1.0e-3
  logging_steps: 1
  save_steps: 1000
"""


def train_run(data: Path, tok: Path, work: Path, streaming: bool, workers: int = 1) -> Dict[str, float]:
    """`bmtrain train` from a cold start: seconds to the first logged step, peak RSS of the process tree."""
    cfg = work / f"{data.stem}-{'stream' if streaming else 'cached'}.yaml"
    out = work / f"out-{data.stem}-{'stream' if streaming else 'cached'}"
    shutil.rmtree(out, ignore_errors=True)  # a cold start: no token cache from an earlier run
    cfg.write_text(_config_text(data, tok, out, streaming, workers))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bmtrain_cli", "train", "--config", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    rss = PeakRSS(proc.pid)
    first: Optional[float] = None
    lines = []
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        if first is None and re.match(r"step 1/", line):
            first = time.perf_counter() - t0
    proc.wait()
    total = time.perf_counter() - t0
    peak = rss.stop()
    if proc.returncode != 0:
        raise RuntimeError("".join(lines[-20:]))
    return {"first_step_s": first or float("nan"), "total_s": total, "peak_rss_mb": peak / 2**20}


def loader_pass(data: Path, tok: Any, workers: int) -> Dict[str, float]:
    """Tokens/s of a StreamLoader reading LOADER_RECORDS records (from the start, first buffer fill
    included), and this process tree's memory (PSS) over the pass."""
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.data.loader import build_loader

    cfg = Config.model_validate(
        {
            "model_config": {"max_seq_len": 256},
            "train_config": {
                "data_path": str(data),
                "template": "plain",
                "streaming": True,
                "max_steps": 1,
                "data_workers": workers,
                "shuffle_buffer": PASS_BUFFER,
                "micro_batch_size": 8,
                "batching": "packed",
            },
        }
    )
    loader = build_loader(cfg, tok)
    it = iter(loader)
    tokens, rss = 0, []
    t0 = time.perf_counter()
    while loader.counts["records"] < LOADER_RECORDS:
        b = next(it)
        tokens += int((b["attention_mask"] > 0).sum())
        if len(rss) < 10 and loader.counts["records"] >= (len(rss) + 1) * LOADER_RECORDS // 10:
            rss.append(tree_rss(os.getpid()))
    s = time.perf_counter() - t0
    loader.close()
    return {
        "tokens_per_s": tokens / s,
        "rss_first_tenth_mb": rss[0] / 2**20,
        "rss_last_mb": rss[-1] / 2**20,
    }


def cache_build(data: Path, tok: Any, workers: int, work: Path) -> float:
    """Tokens/s of a cold token-cache build (prepare-data's work) with ``workers`` processes."""
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.loader import load_dataset

    cache = work / f"cache-{workers}w"
    shutil.rmtree(cache, ignore_errors=True)
    t0 = time.perf_counter()
    ds = load_dataset([str(data)], make_encoder(tok, "plain"), cache_dir=str(cache), workers=workers)
    s = time.perf_counter() - t0
    tokens = int(ds.lengths.sum())
    shutil.rmtree(cache, ignore_errors=True)
    return tokens / s


def step_share(data: Path, tok: Any) -> Dict[str, float]:
    """A tiny LLaMA step against the time the loop waits for the streaming loader (1 worker)."""
    import paddle

    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.data.loader import build_loader
    from bmtrain_cli.models import ModelArch, build

    paddle.seed(0)
    arch = ModelArch(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=tok.vocab_size,
        max_position_embeddings=256,
    )
    model = build(arch, kernels="reference")
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    cfg = Config.model_validate(
        {
            "model_config": {"max_seq_len": 256},
            "train_config": {
                "data_path": str(data),
                "template": "plain",
                "streaming": True,
                "max_steps": 1,
                "data_workers": 1,
                "micro_batch_size": 4,
                "batching": "packed",
            },
        }
    )
    loader = build_loader(cfg, tok)
    it = iter(loader)
    wait = step = 0.0
    steps = 12
    for i in range(steps + 2):
        t0 = time.perf_counter()
        b = next(it)
        t1 = time.perf_counter()
        t = {k: paddle.to_tensor(v) for k, v in b.items()}
        s, c = model.loss_sum(t["input_ids"], t["labels"], t["attention_mask"], t["position_ids"])
        (s / c).backward()
        opt.step()
        opt.clear_grad()
        t2 = time.perf_counter()
        if i >= 2:  # the first buffer fill and warm-up excluded
            wait += t1 - t0
            step += t2 - t0
    loader.close()
    return {"step_ms": 1000 * step / steps, "wait_ms": 1000 * wait / steps, "loader_share": wait / step}


def main() -> Dict[str, Any]:
    from bmtrain_cli.data.tokenizers import load_tokenizer, train_sentencepiece

    work = Path(os.environ.get("BENCH_STREAM_DIR", "/tmp/bmtrain-bench-stream"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in os.environ.get("BENCH_STREAM_SIZES_MB", "200,2000").split(",")]
    t0 = time.perf_counter()
    files = {mb: make_file(work / f"data-{mb}mb.jsonl", mb) for mb in sizes}
    small = make_file(work / "data-20mb.jsonl", 20)
    print(
        f"data in {work}: "
        + ", ".join(f"{p.name}" for p in files.values())
        + f" ({time.perf_counter() - t0:.0f} s)"
    )
    tok_dir = work / "tok"
    if not (tok_dir / "tokenizer.model").exists():
        recs = [json.loads(line) for line in small.read_text().splitlines()[:4000]]
        train_sentencepiece([r["input"] + r["output"] for r in recs], str(tok_dir), vocab_size=2000)
    tok = load_tokenizer(str(tok_dir))

    recs = [json.loads(line) for line in small.read_text().splitlines()[:LOADER_RECORDS]]
    texts = [r["input"] + r["output"] for r in recs]
    t0 = time.perf_counter()
    raw_tokens = sum(len(x) for x in tok.encode_batch(texts))
    raw_tps = raw_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    one_tps = sum(len(tok.encode(t)) for t in texts) / (time.perf_counter() - t0)
    print(
        f"raw tokenizer encode_batch : {raw_tps:,.0f} tokens/s (baseline; sentencepiece may thread over the "
        f"batch; {raw_tokens / len(texts):.0f} tokens per record); encode() one record at a time: {one_tps:,.0f}"
    )
    out: Dict[str, Any] = {
        "raw_tokens_per_s": raw_tps,
        "raw_one_by_one_tokens_per_s": one_tps,
        "sizes_mb": sizes,
    }
    for workers in (0, 1, 2):
        tps = cache_build(small, tok, workers, work)
        out[f"cache_build_{workers}w_tokens_per_s"] = tps
        print(
            f"cold cache build (prepare-data's work), data_workers {workers}: {tps:,.0f} tokens/s "
            f"= {tps / raw_tps:.2f}x raw"
        )
    first_file = files[sizes[0]]
    for workers in (0, 1, 2):
        r = loader_pass(first_file, tok, workers)
        out[f"loader_{workers}w"] = {**r, "vs_raw": r["tokens_per_s"] / raw_tps}
        print(
            f"streaming loader, {workers} worker(s){' (inline)' if workers == 0 else ''}: "
            f"{r['tokens_per_s']:,.0f} tokens/s = {r['tokens_per_s'] / raw_tps:.2f}x raw; RSS "
            f"{r['rss_first_tenth_mb']:.0f} MiB after 10% of the pass, {r['rss_last_mb']:.0f} MiB at its end"
        )

    runs: Dict[int, List[Dict[str, float]]] = {mb: [] for mb in files}
    for _ in range(2):  # each size twice, interleaved; the faster run counts (a shared, noisy machine)
        for mb, path in files.items():
            runs[mb].append(train_run(path, tok_dir, work, streaming=True))
    for mb in files:
        r = min(runs[mb], key=lambda x: x["first_step_s"])
        r["first_step_s_runs"] = [x["first_step_s"] for x in runs[mb]]  # type: ignore[assignment]
        out[f"train_stream_{mb}mb"] = r
        print(
            f"bmtrain train, streaming {mb} MiB: first step after {r['first_step_s']:.1f} s "
            f"(runs: {', '.join(f'{x:.1f}' for x in r['first_step_s_runs'])}), "
            f"{TRAIN_STEPS} steps in {r['total_s']:.1f} s, peak RSS (with workers) {r['peak_rss_mb']:.0f} MiB"
        )
    r = train_run(small, tok_dir, work, streaming=False)
    out["train_cached_20mb"] = r
    print(
        f"bmtrain train, cached 20 MiB (tokenise all first): first step after {r['first_step_s']:.1f} s, "
        f"peak RSS {r['peak_rss_mb']:.0f} MiB"
    )
    share = step_share(first_file, tok)
    out.update(share)
    print(
        f"tiny model step {share['step_ms']:.1f} ms, waiting for the streaming loader {share['wait_ms']:.2f} ms "
        f"= {100 * share['loader_share']:.2f}% of the step"
    )
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
