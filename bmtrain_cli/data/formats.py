"""Record formats: turn one parsed JSON record into a Conversation (or plain text), or say why it is bad.

Formats (``data_format`` in the config, or ``auto`` = detected per record):
  input_output  {"input": str, "output": str, "system"?: str}
  alpaca        {"instruction": str, "input"?: str, "output": str, "system"?: str}
  chat          {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...],
                 "tools"?: [JSON schema, ...]}  (assistant turns may carry OpenAI ``tool_calls`` and
                 ``reasoning_content``; LLaMA-Factory's sharegpt ``conversations`` with from/value turns
                 and its ``function_call``/``observation`` roles are read too, see data/tools.py)
  text          {"text": str}                         (continued pre-training: every token is trained)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from bmtrain_cli.data.record_error import BadRecord
from bmtrain_cli.data.tools import parse_message, parse_tools

FORMATS = ("input_output", "alpaca", "chat", "text")


@dataclass(frozen=True)
class Conversation:
    """A sample: an optional system prompt and alternating turns, or plain text (``text`` set)."""

    messages: Tuple[Tuple[str, str], ...] = ()  # (role, content), roles user/assistant/tool
    system: Optional[str] = None
    text: Optional[str] = None
    meta: dict = field(default_factory=dict, compare=False)
    extras: Tuple[dict, ...] = ()  # per message (empty, or one per message): tool_calls, loss, ...
    tools: Optional[Tuple[dict, ...]] = None  # the record's tool schemas

    @property
    def is_text(self) -> bool:
        return self.text is not None


def detect_format(record: Any) -> str:
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record or "conversations" in record:
        return "chat"
    if "instruction" in record:
        return "alpaca"
    if "output" in record or "input" in record:
        return "input_output"
    if "text" in record:
        return "text"
    keys = ", ".join(sorted(record)) or "none"
    raise BadRecord(
        f"unrecognised record (keys: {keys}); expected input/output, instruction/output, messages or text"
    )


def _string(record: dict, key: str, *, non_empty: bool = True) -> str:
    if key not in record or record[key] is None:
        raise BadRecord(f'missing field "{key}"')
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f'field "{key}" must be a string, got {type(value).__name__}')
    if non_empty and not value.strip():
        raise BadRecord(f'field "{key}" is empty')
    return value


def _optional_string(record: dict, key: str) -> Optional[str]:
    """The string ``record[key]`` (empty too), or None when the field is missing or null."""
    return None if record.get(key) is None else _string(record, key, non_empty=False)


def parse_record(record: Any, data_format: str = "auto") -> Conversation:
    """Validate one record and return its Conversation; raises BadRecord with the reason."""
    fmt = detect_format(record) if data_format == "auto" else data_format
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "input_output":
        prompt = _string(record, "input", non_empty=False)
        answer = _string(record, "output")
        system = _optional_string(record, "system")
        return Conversation(messages=(("user", prompt), ("assistant", answer)), system=system or None)
    if fmt == "alpaca":
        instruction = _string(record, "instruction")
        extra = _optional_string(record, "input")
        answer = _string(record, "output")
        system = _optional_string(record, "system")
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return Conversation(messages=(("user", prompt), ("assistant", answer)), system=system or None)
    if fmt == "text":
        return Conversation(text=_string(record, "text"))
    if fmt == "chat":
        return parse_chat(record)
    raise BadRecord(f"unknown data_format {fmt!r}; expected one of {', '.join(FORMATS)}")


def parse_chat(record: dict) -> Conversation:
    """The conversation of a chat record (``messages`` or ``conversations``: role/content or from/value
    turns, tool calls, tool results); BadRecord says why not."""
    key = "messages" if "messages" in record or "conversations" not in record else "conversations"
    msgs = record.get(key)
    if not isinstance(msgs, list):
        raise BadRecord(f'field "{key}" must be a list, got {type(msgs).__name__}')
    if not msgs:
        raise BadRecord(f'field "{key}" is empty')
    system: Optional[str] = _optional_string(record, "system") or None
    turns: List[Tuple[str, str]] = []
    extras: List[dict] = []
    for i, m in enumerate(msgs):
        where = f"{key}[{i}]"
        role, content, extra = parse_message(m, where)
        if role == "system":
            if turns or (system is not None and i > 0):
                raise BadRecord(f"{where}: a system message may only come first")
            system = content
            continue
        _check_order(turns, extras, role, where)
        turns.append((role, content))
        extras.append(extra)
    if not any(r == "assistant" for r, _ in turns):
        raise BadRecord("no assistant turn: nothing to train on")
    while turns[-1][0] != "assistant":
        turns.pop()  # a trailing question or tool result without an answer carries no loss
        extras.pop()
    tools = parse_tools(record.get("tools"))
    rich = tools is not None or any(extras)
    return Conversation(
        messages=tuple(turns), system=system, extras=tuple(extras) if rich else (), tools=tools
    )


def _check_order(turns: List[Tuple[str, str]], extras: List[dict], role: str, where: str) -> None:
    """Turns alternate user/assistant; tool results follow an assistant turn with tool calls (or another
    tool result) and are answered by the assistant."""
    prev = turns[-1][0] if turns else None
    if role == "tool":
        if prev == "tool" or (prev == "assistant" and extras[-1].get("tool_calls")):
            return
        raise BadRecord(f"{where}: a tool result must follow an assistant turn with tool_calls")
    expected = "user" if prev in (None, "assistant") else "assistant"
    if prev == "tool":
        expected = "assistant"
    if role != expected:
        raise BadRecord(f"{where}: expected a {expected} turn, got {role} (turns must alternate)")
