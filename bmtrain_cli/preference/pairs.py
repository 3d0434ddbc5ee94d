"""Preference records -> tokenised pairs, cached like SFT data (data/cache.py's layout and lock).

A record is a JSON object with ``chosen`` and ``rejected`` (strings, or a list holding one assistant
message as TRL's conversational format writes it) and a prompt: ``prompt`` (a string, or a list of chat
messages) or ``messages`` (chat messages ending with a user turn); ``system`` is optional. Both responses
are rendered with the same template as SFT data, so pair k of a file is stored as samples 2k (chosen) and
2k + 1 (rejected), each with its trained mask (the response tokens and the template's end of turn).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Optional, Tuple

import numpy as np

from bmtrain_cli.data.cache import (
    CACHE_VERSION,
    Rejections,
    TokenStore,
    cached_store,
    default_cache_root,
    file_hash,
    finish_store,
    template_id,
)
from bmtrain_cli.data.encode import Encoder
from bmtrain_cli.data.formats import BadRecord, Conversation, parse_chat
from bmtrain_cli.data.readers import read_records


def _response(record: dict, key: str) -> str:
    value = record.get(key)
    if isinstance(value, list):  # TRL's conversational form: [{"role": "assistant", "content": ...}]
        if len(value) != 1 or not isinstance(value[0], dict) or value[0].get("role") != "assistant":
            raise BadRecord(f'field "{key}" must be a string or a list of one assistant message')
        value = value[0].get("content")
    if value is None:
        raise BadRecord(f'missing field "{key}"')
    if not isinstance(value, str):
        raise BadRecord(f'field "{key}" must be a string, got {type(value).__name__}')
    if not value.strip():
        raise BadRecord(f'field "{key}" is empty')
    return value


def _prompt_turns(record: dict) -> Tuple[Tuple[Tuple[str, str], ...], Optional[str]]:
    prompt = record.get("prompt", record.get("messages"))
    if prompt is None:
        raise BadRecord('missing field "prompt" (a string, or chat messages in "prompt" or "messages")')
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRecord(f'field "system" must be a string, got {type(system).__name__}')
    if isinstance(prompt, str):
        return (("user", prompt),), system or None
    if not isinstance(prompt, list):
        raise BadRecord(f'field "prompt" must be a string or a list of messages, got {type(prompt).__name__}')
    last = prompt[-1] if prompt else None
    if not isinstance(last, dict) or last.get("role", last.get("from")) not in ("user", "human"):
        raise BadRecord("the prompt's messages must end with a user turn")
    # parsed with SFT's chat rules; a placeholder answer completes the last turn
    conv = parse_chat({"messages": [*prompt, {"role": "assistant", "content": "x"}]})
    turns = conv.messages[:-1]
    if system is not None and conv.system is not None:
        raise BadRecord('give the system prompt once: in "system" or as the first message')
    return turns, conv.system if conv.system is not None else (system or None)


def parse_pair(record: Any) -> Tuple[Conversation, Conversation]:
    """(chosen conversation, rejected conversation) of one record; raises BadRecord with the reason."""
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    chosen, rejected = _response(record, "chosen"), _response(record, "rejected")
    turns, system = _prompt_turns(record)
    if chosen == rejected:
        raise BadRecord("chosen and rejected are the same text: the pair carries no preference")
    return (
        Conversation(messages=(*turns, ("assistant", chosen)), system=system),
        Conversation(messages=(*turns, ("assistant", rejected)), system=system),
    )


def pair_cache_key(path: str, encoder: Encoder) -> str:
    parts = [
        f"pref-v{CACHE_VERSION}",
        file_hash(path),
        encoder.tokenizer.fingerprint(),
        template_id(encoder.template),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _tokenize_pairs(path: str, encoder: Encoder, sink: Path) -> None:
    """Every record of ``path`` into sink (tokens.bin, mask.bin, offsets.npy, lines.npy, meta.json last)."""
    rejections = Rejections(path)
    offsets, lines = [0], []
    n_records = 0
    with open(sink / "tokens.bin", "wb") as ftok, open(sink / "mask.bin", "wb") as fmask:
        for rec in read_records(path):
            n_records += 1
            if rec.error is not None:
                rejections.add(rec.line, rec.error, rec.raw)
                continue
            try:
                encoded = encoder.encode_many(list(parse_pair(rec.value)))
            except BadRecord as exc:
                rejections.add(rec.line, str(exc), rec.raw)
                continue
            if not all(any(mask) for _, mask in encoded):
                rejections.add(rec.line, "no trained token in a response", rec.raw)
                continue
            for ids, mask in encoded:
                ftok.write(np.asarray(ids, dtype=np.int32).tobytes())
                fmask.write(np.asarray(mask, dtype=np.uint8).tobytes())
                offsets.append(offsets[-1] + len(ids))
                lines.append(rec.line)
    finish_store(sink, offsets, lines, n_records, rejections, kind="preference")


def open_or_build_pairs(
    path: str, encoder: Encoder, cache_root: Optional[str] = None, output_dir: Optional[str] = None
) -> TokenStore:
    """The pair store of ``path`` (samples 2k, 2k + 1 = chosen, rejected of pair k): cached or built now."""
    root = Path(cache_root) if cache_root else default_cache_root(path, output_dir)
    name = f"{Path(path).stem}-{pair_cache_key(path, encoder)}"
    return cached_store(path, root, name, lambda directory: _tokenize_pairs(path, encoder, directory))
