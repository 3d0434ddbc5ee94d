"""Tool calling and reasoning in chat records: messages as OpenAI, TRL and LLaMA-Factory lay them out.

A message is ``{"role", "content"}`` (or sharegpt ``{"from", "value"}``). Assistant messages may carry
``tool_calls`` (OpenAI: ``[{"type": "function", "function": {"name", "arguments"}}]``), ``reasoning_content``
and a loss flag (``loss: false`` or ``weight: 0`` = not trained); ``tool`` messages are tool results.
LLaMA-Factory's sharegpt roles map as: human -> user, gpt -> assistant, function_call -> an assistant turn
whose value is the JSON call(s) ``{"name", "arguments"}``, observation -> tool. A record's ``tools`` is a
list of JSON schemas (or that list as a JSON string, as LLaMA-Factory stores it).
"""

from __future__ import annotations

import json
from typing import Any, List, Optional, Tuple

from bmtrain_cli.data.record_error import BadRecord

ROLE_ALIASES = {
    "human": "user",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "observation": "tool",
    "function": "tool",
    "ipython": "tool",
}
ROLES = ("system", "user", "assistant", "tool", "function_call")
PASSED_KEYS = ("tool_calls", "reasoning_content", "name", "tool_call_id")  # given to the chat template


def parse_tools(value: Any) -> Optional[Tuple[dict, ...]]:
    """The record's tool schemas, or None when it has none."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise BadRecord(f'field "tools" is not valid JSON: {exc}') from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise BadRecord('field "tools" must be a list of JSON schema objects')
    return tuple(value) or None


def _calls_from_value(value: str, where: str) -> List[dict]:
    """LLaMA-Factory's function_call value: one call or a list of calls as JSON."""
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise BadRecord(f"{where}: function_call value is not valid JSON: {exc}") from None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise BadRecord(f'{where}: a function call must be an object with a "name"')
        args = c.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({"type": "function", "function": {"name": c["name"], "arguments": args}})
    return out


def _check_calls(calls: Any, where: str) -> List[dict]:
    if not isinstance(calls, list) or not calls:
        raise BadRecord(f"{where}: tool_calls must be a non-empty list")
    for j, c in enumerate(calls):
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecord(f'{where}: tool_calls[{j}] needs a function "name"')
    return calls


def _trained(m: dict, where: str) -> bool:
    loss = m.get("loss", True)
    weight = m.get("weight", 1)
    if not isinstance(loss, bool) or not isinstance(weight, (int, float)) or isinstance(weight, bool):
        raise BadRecord(f"{where}: loss must be true/false and weight a number")
    if weight not in (0, 1):
        raise BadRecord(f"{where}: weight must be 0 or 1, got {weight}")
    return loss and weight == 1


def parse_message(m: Any, where: str) -> Tuple[str, str, dict]:
    """(role, content, extras) of one message; extras holds tool_calls, reasoning_content, name,
    tool_call_id and ``loss: False`` when the turn is not trained."""
    if not isinstance(m, dict):
        raise BadRecord(f"{where} must be an object, got {type(m).__name__}")
    role: Any = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise BadRecord(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
    extra = {k: m[k] for k in PASSED_KEYS if m.get(k) is not None}
    if role == "function_call":
        if not isinstance(content, str):
            raise BadRecord(f"{where}: function_call value must be a JSON string")
        role, content, extra["tool_calls"] = "assistant", "", _calls_from_value(content, where)
    if content is None and extra.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise BadRecord(f"{where}: content must be a string, got {type(content).__name__}")
    if "tool_calls" in extra:
        if role != "assistant":
            raise BadRecord(f"{where}: only assistant turns carry tool_calls")
        _check_calls(extra["tool_calls"], where)
    if "reasoning_content" in extra and not isinstance(extra["reasoning_content"], str):
        raise BadRecord(f"{where}: reasoning_content must be a string")
    if role == "assistant":
        if not content.strip() and not extra.get("tool_calls"):
            raise BadRecord(f"{where}: assistant content is empty")
        if not _trained(m, where):
            extra["loss"] = False
    return role, content, extra


def has_tools(conv: Any) -> bool:
    """Whether a conversation needs a template that renders tools."""
    return (
        bool(conv.tools)
        or any(r == "tool" for r, _ in conv.messages)
        or any(e.get("tool_calls") for e in conv.extras)
    )


def tool_turns(conv: Any) -> Tuple[int, int]:
    """(assistant turns with tool calls, tool results) of a conversation, for data-stats."""
    calls = sum(1 for e in conv.extras if e.get("tool_calls"))
    results = sum(1 for r, _ in conv.messages if r == "tool")
    return calls, results
