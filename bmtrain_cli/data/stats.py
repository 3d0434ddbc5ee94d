"""Data statistics: token lengths, truncation, and the padding waste of each batching mode."""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from bmtrain_cli.data.collate import pack


def padding_waste(
    lengths: np.ndarray, order: np.ndarray, max_len: int, rows_per_batch: int
) -> Dict[str, float]:
    """Fraction of batch slots that are padding, per batching mode, for one epoch in ``order``."""
    eff = np.minimum(lengths[order], max_len)
    tokens = float(eff.sum())
    n = len(eff)
    out: Dict[str, float] = {}
    out["max_length"] = 1.0 - tokens / (n * max_len) if n else 0.0
    slots = 0
    for i in range(0, n, rows_per_batch):
        chunk = eff[i : i + rows_per_batch]
        slots += len(chunk) * int(chunk.max())
    out["longest"] = 1.0 - tokens / slots if slots else 0.0
    rows = pack(order, np.minimum(lengths, max_len), max_len)
    out["packed"] = 1.0 - tokens / (len(rows) * max_len) if rows else 0.0
    out["packed_rows"] = float(len(rows))
    return out


def data_stats(loader: Any) -> Dict[str, Any]:
    """Everything `bmtrain data-stats` prints, from a built Loader (every record has been read)."""
    ds = loader.dataset
    lengths = ds.lengths
    pct = {f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)} if len(lengths) else {}
    order = loader._epoch_samples(0)
    base = loader.stats()
    return {
        **base,
        "files": [s.file for s in ds.stores],
        "cache_dirs": [str(s.directory) for s in ds.stores],
        "length": {
            "min": int(lengths.min()),
            **pct,
            "max": int(lengths.max()),
            "mean": float(lengths.mean()),
        },
        "trained_tokens": int(sum(int(np.asarray(s.mask).sum()) for s in ds.stores)),
        "max_seq_len": loader.max_seq_len,
        "padding_waste": padding_waste(
            ds.lengths, order, loader.max_seq_len, loader.micro_batch_size * loader.data_world
        ),
    }


def format_stats(st: Dict[str, Any]) -> List[str]:
    ln = st["length"]
    w = st["padding_waste"]
    lines = []
    smp = st.get("sample")
    if smp is not None:
        est = f", about {smp['estimated_records']:,} records in all" if smp["estimated_records"] else ""
        lines.append(
            f"sample: {smp['records']} records drawn at random from {smp['data_bytes'] / 2**20:.0f} MiB of "
            f"data{est}; the figures below are of the sample"
        )
    lines += [
        f"files: {len(st['files'])}  records: {st['records']}  usable: {st['samples']}  rejected: {st['rejected']}",
        f"tokens: {st['tokens']} after truncation to max_seq_len (trained: {st['trained_tokens']})",
        "token length: "
        + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in ln.items()),
        f"longer than max_seq_len {st['max_seq_len']}: {st['overlong']} "
        f"(truncated: {st['truncated']}, answer cut: {st['truncated_answer']}, dropped: {st['dropped']})",
        "padding waste: "
        + "  ".join(f"{m} {100 * w[m]:.1f}%" for m in ("max_length", "longest", "packed"))
        + f"  (packed rows: {int(w['packed_rows'])})",
        f"per epoch: {st['samples_per_epoch']} samples, {st['batches_per_epoch']} micro-batches per data rank",
    ]
    tools = st.get("tools")
    if tools and tools["records_with_tools"]:
        lines.append(
            f"tool calling: {tools['records_with_tools']} records with tools, "
            f"{tools['tool_call_turns']} assistant turns with tool calls, {tools['tool_results']} tool results"
        )
    return lines


def tool_stats(files: List[str], data_format: str = "auto") -> dict:
    """Records with tools, assistant turns with tool calls, and tool results over the usable records of
    the files (for data-stats)."""
    from bmtrain_cli.data.formats import BadRecord, parse_record
    from bmtrain_cli.data.readers import read_records
    from bmtrain_cli.data.tools import tool_turns

    out = {"records_with_tools": 0, "tool_call_turns": 0, "tool_results": 0}
    for path in files:
        for rec in read_records(path):
            if rec.error:
                continue
            try:
                conv = parse_record(rec.value, data_format)
            except BadRecord:
                continue
            calls, results = tool_turns(conv)
            out["records_with_tools"] += int(bool(conv.tools) or calls > 0)
            out["tool_call_turns"] += calls
            out["tool_results"] += results
    return out
