"""Data loader throughput against raw tokenizer encoding, and the loader's share of a training step.

Run: python benchmarks/run_all.py data     (or: python benchmarks/bench_data.py)

Baselines measured in the same run:
  raw      tokenizer.encode(prompt + answer) over every record (text already in memory)
  cold     load_dataset: read JSONL, validate, template, tokenise, write the memory-mapped cache
  warm     one epoch of micro-batches from the cache (what every later run, and every epoch, does)
  step     a tiny LLaMA training step (h64, 2 layers) vs the time the loop waits for the next batch
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

WORDS = (
    "the model learns to answer questions about data files tokens batches training loss gradient step "
    "paddle config template prompt response system user assistant sample record format cache index "
    "packing padding position attention mask segment epoch shard rank resume checkpoint"
).split()


def _make_records(n: int, seed: int = 0) -> list:
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + "."

    return [
        {
            "input": sentence(rng.randint(8, 30)) + "\n" + sentence(rng.randint(0, 20)) + "\n",
            "output": " ".join(sentence(rng.randint(5, 15)) for _ in range(rng.randint(2, 8))),
        }
        for _ in range(n)
    ]


def main() -> Dict[str, Any]:
    from bmtrain_cli.config.schema import Config
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.loader import Loader, load_dataset
    from bmtrain_cli.data.tokenizers import train_sentencepiece

    n = 4000
    records = _make_records(n)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        path = d / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        texts = [r["input"] + r["output"] for r in records]
        tok = train_sentencepiece(texts[:2000], str(d / "tok"), vocab_size=2000)

        t0 = time.perf_counter()
        raw_tokens = sum(len(tok.encode(t)) for t in texts)
        raw_s = time.perf_counter() - t0

        enc = make_encoder(tok, "plain")  # same text as the baseline, plus BOS/EOS
        t0 = time.perf_counter()
        ds = load_dataset([str(path)], enc, cache_dir=str(d / "cache"), output_dir=str(d / "out"))
        cold_s = time.perf_counter() - t0
        loader_tokens = int(ds.lengths.sum())

        t0 = time.perf_counter()
        ds2 = load_dataset([str(path)], enc, cache_dir=str(d / "cache"), output_dir=str(d / "out"))
        reuse_s = time.perf_counter() - t0
        assert not ds2.stores[0].built

        loader = Loader(ds2, max_seq_len=512, micro_batch_size=8, pad_id=tok.pad_id, bos_id=tok.bos_id)
        t0 = time.perf_counter()
        warm_tokens = 0
        it = iter(loader)
        for _ in range(len(loader)):
            b = next(it)
            warm_tokens += int((b["attention_mask"] > 0).sum())
        warm_s = time.perf_counter() - t0

        share = _step_share(ds2, tok, Config)

    out = {
        "records": n,
        "raw_tokens_per_s": raw_tokens / raw_s,
        "cold_tokens_per_s": loader_tokens / cold_s,
        "warm_tokens_per_s": warm_tokens / warm_s,
        "cold_vs_raw": (loader_tokens / cold_s) / (raw_tokens / raw_s),
        "warm_vs_raw": (warm_tokens / warm_s) / (raw_tokens / raw_s),
        "cache_reuse_s": reuse_s,
        **share,
    }
    print(f"records {n}, tokens {loader_tokens} (raw encode of the same text: {raw_tokens})")
    print(f"raw tokenizer encode : {out['raw_tokens_per_s']:,.0f} tokens/s (baseline)")
    print(f"loader, cold (cache) : {out['cold_tokens_per_s']:,.0f} tokens/s = {out['cold_vs_raw']:.2f}x raw")
    print(f"loader, warm (epoch) : {out['warm_tokens_per_s']:,.0f} tokens/s = {out['warm_vs_raw']:.1f}x raw")
    print(f"cache reuse check    : {reuse_s * 1000:.1f} ms")
    print(
        f"tiny model step {share['step_ms']:.1f} ms, waiting for data {share['wait_ms']:.3f} ms "
        f"= {100 * share['loader_share']:.2f}% of the step (prefetch thread)"
    )
    print(
        f"making one batch without prefetch: {share['batch_make_ms']:.2f} ms "
        f"= {100 * share['loader_share_no_prefetch']:.2f}% of the step"
    )
    return out


def _step_share(ds: Any, tok: Any, _config: Any) -> Dict[str, float]:
    import paddle

    from bmtrain_cli.data.loader import Loader
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
    loader = Loader(
        ds,
        max_seq_len=256,
        micro_batch_size=8,
        pad_id=tok.pad_id,
        bos_id=tok.bos_id,
        batching="packed",
        num_workers=1,
    )
    bare = Loader(
        ds, max_seq_len=256, micro_batch_size=8, pad_id=tok.pad_id, bos_id=tok.bos_id, batching="packed"
    )
    t0 = time.perf_counter()
    bit = iter(bare)
    for _ in range(50):
        next(bit)
    make_ms = 1000 * (time.perf_counter() - t0) / 50
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
        if i >= 2:  # warm-up steps excluded
            wait += t1 - t0
            step += t2 - t0
    step_ms = 1000 * step / steps
    return {
        "step_ms": step_ms,
        "wait_ms": 1000 * wait / steps,
        "loader_share": wait / step,
        "batch_make_ms": make_ms,
        "loader_share_no_prefetch": make_ms / step_ms,
    }


if __name__ == "__main__":
    main()
