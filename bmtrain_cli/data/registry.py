"""LLaMA-Factory's dataset registry: ``train_config.dataset`` names entries of ``dataset_dir/dataset_info.json``.

Each entry (LLaMA-Factory's layout) gives ``file_name`` (a JSON/JSONL file, or a directory of them, under
``dataset_dir``), ``formatting`` (alpaca, the default, or sharegpt), ``columns`` (prompt, query,
response, history, messages, system, tools, chosen, rejected), ``tags`` (role_tag, content_tag,
user_tag, assistant_tag, observation_tag, function_tag, system_tag), ``ranking`` (preference pairs) and
``num_samples`` (the first N records, cycled when the file has fewer). The records are rewritten into
this tool's own formats (alpaca, chat, preference pairs) in ``dataset_dir/.bmtrain_registry/``, named by
a hash of the entry and the source file, and that file is the data_path. Entries that need the network
(``hf_hub_url``, ``ms_hub_url``, ``script_url``, ``om_hub_url``, ``cloud_file_name``) are refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from itertools import cycle, islice
from pathlib import Path
from typing import Any, Dict, Iterator, List

from bmtrain_cli.errors import UserError

INFO_FILE = "dataset_info.json"
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "history": None}
SHAREGPT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}


def dataset_names(value: Any) -> List[str]:
    names = value.split(",") if isinstance(value, str) else list(value)
    return [str(n).strip() for n in names if str(n).strip()]


def load_info(dataset_dir: str) -> Dict[str, Any]:
    path = Path(dataset_dir) / INFO_FILE
    if not path.is_file():
        raise UserError(f"train_config.dataset needs {path} (LLaMA-Factory's registry); it does not exist")
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(info, dict):
        raise UserError(f"{path}: expected an object of named datasets")
    return info


def _entry(info: Dict[str, Any], name: str, info_path: Path) -> Dict[str, Any]:
    if name not in info:
        import difflib

        close = difflib.get_close_matches(name, list(info), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"{info_path}: no dataset named {name!r}{hint}")
    entry = info[name]
    remote = [k for k in REMOTE_KEYS if isinstance(entry, dict) and entry.get(k)]
    if remote and not entry.get("file_name"):
        raise UserError(
            f"{info_path}: dataset {name!r} is fetched from the network ({remote[0]}: {entry[remote[0]]}); "
            "download it, then point the entry's file_name at the local file"
        )
    if not isinstance(entry, dict) or not isinstance(entry.get("file_name"), str):
        raise UserError(f"{info_path}: dataset {name!r} has no file_name")
    if entry.get("formatting", "alpaca") not in ("alpaca", "sharegpt"):
        raise UserError(f"{info_path}: dataset {name!r}: formatting must be alpaca or sharegpt")
    return entry


def _source_files(root: Path) -> List[Path]:
    if root.is_dir():
        return sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    if not root.is_file():
        raise UserError(f"{root}: the registry's file_name does not exist")
    return [root]


def _records(files: List[Path]) -> Iterator[Any]:
    from bmtrain_cli.data.readers import read_records

    for f in files:
        for rec in read_records(str(f)):
            if rec.error:
                raise UserError(f"{rec.where()}: {rec.error}")
            yield rec.value


def _alpaca(rec: dict, cols: Dict[str, Any], ranking: bool) -> dict:
    prompt = rec.get(cols.get("prompt", "instruction"), "")
    query = rec.get(cols.get("query", "input"), "")
    text = f"{prompt}\n{query}" if query else prompt  # LLaMA-Factory joins them with a newline
    msgs: List[dict] = []
    for old_q, old_a in rec.get(cols.get("history") or "history", None) or []:
        msgs += [{"role": "user", "content": old_q}, {"role": "assistant", "content": old_a}]
    msgs.append({"role": "user", "content": text})
    out: Dict[str, Any] = {}
    system = rec.get(cols.get("system", "system"))
    if system:
        out["system"] = system
    if ranking:
        out.update(messages=msgs, chosen=rec.get(cols.get("chosen", "chosen")))
        out["rejected"] = rec.get(cols.get("rejected", "rejected"))
        return out
    msgs.append({"role": "assistant", "content": rec.get(cols.get("response", "output"))})
    tools = rec.get(cols.get("tools", "tools"))
    return {**out, "messages": msgs, **({"tools": tools} if tools else {})}


def _turn(m: Any, tags: Dict[str, str]) -> dict:
    if not isinstance(m, dict):
        return {"role": None, "content": m}
    role: Any = m.get(tags["role_tag"])
    names = {
        tags["user_tag"]: "user",
        tags["assistant_tag"]: "assistant",
        tags["observation_tag"]: "tool",
        tags["function_tag"]: "function_call",
        tags["system_tag"]: "system",
    }
    return {"role": names.get(role, role), "content": m.get(tags["content_tag"])}


def _sharegpt(rec: dict, cols: Dict[str, Any], tags: Dict[str, str], ranking: bool) -> dict:
    msgs = [_turn(m, tags) for m in rec.get(cols.get("messages", "conversations")) or []]
    out: Dict[str, Any] = {"messages": msgs}
    system = rec.get(cols.get("system", "system"))
    if system:
        out["system"] = system
    tools = rec.get(cols.get("tools", "tools"))
    if tools:
        out["tools"] = tools
    if ranking:
        for key in ("chosen", "rejected"):
            value = rec.get(cols.get(key, key))
            out[key] = _turn(value, tags)["content"] if isinstance(value, dict) else value
    return out


def _convert(entry: Dict[str, Any], records: Iterator[Any]) -> Iterator[dict]:
    cols = entry.get("columns") or {}
    tags = {**SHAREGPT_TAGS, **(entry.get("tags") or {})}
    ranking = bool(entry.get("ranking"))
    sharegpt = entry.get("formatting", "alpaca") == "sharegpt"
    for rec in records:
        if not isinstance(rec, dict):
            yield {"not_an_object": rec}  # rejected by the loader with the reason
        elif sharegpt:
            yield _sharegpt(rec, cols, tags, ranking)
        else:
            yield _alpaca(rec, cols, ranking)


def materialize(name: str, dataset_dir: str) -> str:
    """The local JSONL of registry entry ``name`` in this tool's formats (written once, then reused)."""
    info_path = Path(dataset_dir) / INFO_FILE
    entry = _entry(load_info(dataset_dir), name, info_path)
    files = _source_files(Path(dataset_dir) / entry["file_name"])
    h = hashlib.sha256(json.dumps(entry, sort_keys=True).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    out_dir = Path(dataset_dir) / ".bmtrain_registry"
    out = out_dir / f"{name}-{h.hexdigest()[:16]}.jsonl"
    if out.is_file():
        return str(out)
    records: Iterator[Any] = _records(files)
    n = entry.get("num_samples")
    if isinstance(n, int) and n > 0:
        records = islice(cycle(list(records)), n)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for rec in _convert(entry, records):
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    return str(out)


def expand_registry(data: Dict[str, Any]) -> Dict[str, Any]:
    """The raw config with ``train_config.dataset`` resolved into ``data_path`` (unchanged without it)."""
    t = data.get("train_config")
    if not isinstance(t, dict) or not t.get("dataset"):
        return data
    if t.get("data_path"):
        raise UserError("train_config: set either dataset (the registry) or data_path, not both")
    dataset_dir = str(t.get("dataset_dir") or "data")
    paths = [materialize(n, dataset_dir) for n in dataset_names(t["dataset"])]
    return {**data, "train_config": {**t, "data_path": paths}}
