"""Record formats: turn one parsed JSON record into a Conversation (or plain text), or say why it is bad.

Formats (``data_format`` in the config, or ``auto`` = detected per record):
  input_output  {"input": str, "output": str, "system"?: str}
  alpaca        {"instruction": str, "input"?: str, "output": str, "system"?: str}
  chat          {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  text          {"text": str}                         (continued pre-training: every token is trained)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

FORMATS = ("input_output", "alpaca", "chat", "text")
ROLES = ("system", "user", "assistant")


class BadRecord(ValueError):
    """A record that cannot be used; the message is the reason (file and line are added by the reader)."""


@dataclass(frozen=True)
class Conversation:
    """A sample: an optional system prompt and alternating turns, or plain text (``text`` set)."""

    messages: Tuple[Tuple[str, str], ...] = ()  # (role, content), roles user/assistant
    system: Optional[str] = None
    text: Optional[str] = None
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def is_text(self) -> bool:
        return self.text is not None


def detect_format(record: Any) -> str:
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
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


def _string(record: dict, key: str, *, required: bool = True, non_empty: bool = True) -> Optional[str]:
    if key not in record or record[key] is None:
        if required:
            raise BadRecord(f'missing field "{key}"')
        return None
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(f'field "{key}" must be a string, got {type(value).__name__}')
    if non_empty and not value.strip():
        raise BadRecord(f'field "{key}" is empty')
    return value


def parse_record(record: Any, data_format: str = "auto") -> Conversation:
    """Validate one record and return its Conversation; raises BadRecord with the reason."""
    fmt = detect_format(record) if data_format == "auto" else data_format
    if not isinstance(record, dict):
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    if fmt == "input_output":
        prompt = _string(record, "input", non_empty=False)
        answer = _string(record, "output")
        system = _string(record, "system", required=False, non_empty=False)
        return Conversation(messages=(("user", prompt), ("assistant", answer)), system=system or None)
    if fmt == "alpaca":
        instruction = _string(record, "instruction")
        extra = _string(record, "input", required=False, non_empty=False)
        answer = _string(record, "output")
        system = _string(record, "system", required=False, non_empty=False)
        prompt = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
        return Conversation(messages=(("user", prompt), ("assistant", answer)), system=system or None)
    if fmt == "text":
        return Conversation(text=_string(record, "text"))
    if fmt == "chat":
        return parse_chat(record)
    raise BadRecord(f"unknown data_format {fmt!r}; expected one of {', '.join(FORMATS)}")


def parse_chat(record: dict) -> Conversation:
    """The conversation of a chat record (``messages``: role/content or from/value turns); BadRecord says why not."""
    msgs = record.get("messages")
    if not isinstance(msgs, list):
        raise BadRecord(f'field "messages" must be a list, got {type(msgs).__name__}')
    if not msgs:
        raise BadRecord('field "messages" is empty')
    system: Optional[str] = None
    turns: List[Tuple[str, str]] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRecord(f"{where} must be an object, got {type(m).__name__}")
        role = m.get("role", m.get("from"))
        content = m.get("content", m.get("value"))
        role = {"human": "user", "gpt": "assistant", "bot": "assistant"}.get(role, role)
        if role not in ROLES:
            raise BadRecord(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise BadRecord(f"{where}: content must be a string, got {type(content).__name__}")
        if role == "system":
            if turns or system is not None:
                raise BadRecord(f"{where}: a system message may only come first")
            system = content
            continue
        expected = "user" if not turns or turns[-1][0] == "assistant" else "assistant"
        if role != expected:
            raise BadRecord(f"{where}: expected a {expected} turn, got {role} (turns must alternate)")
        if role == "assistant" and not content.strip():
            raise BadRecord(f"{where}: assistant content is empty")
        turns.append((role, content))
    if not any(r == "assistant" for r, _ in turns):
        raise BadRecord("no assistant turn: nothing to train on")
    if turns[-1][0] == "user":
        turns.pop()  # a trailing question without an answer carries no loss
    return Conversation(messages=tuple(turns), system=system)
