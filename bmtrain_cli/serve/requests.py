"""Reading OpenAI-style request bodies: size and encoding limits, JSON, and the sampling parameters,
each refused with a RequestError naming the parameter (never an exception from deeper down)."""

from __future__ import annotations

import json
import secrets
from typing import Any, Dict, List, Optional

from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.serve.engine import Engine, RequestError, Sampling

MAX_N = 8
MAX_STOPS = 4


def parse_json(raw: bytes) -> Dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(
            400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _number(body: Dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(400, f"{name} must be a number, got {type(value).__name__}", param=name)
    if not lo <= value <= hi:
        raise RequestError(400, f"{name} must be between {lo} and {hi}, got {value}", param=name)
    return float(value)


def _integer(body: Dict[str, Any], name: str, default: Optional[int], lo: int, hi: int) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(400, f"{name} must be an integer, got {type(value).__name__}", param=name)
    if not lo <= value <= hi:
        raise RequestError(400, f"{name} must be between {lo} and {hi}, got {value}", param=name)
    return value


def _stops(body: Dict[str, Any]) -> List[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(400, "stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise RequestError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    return stops


def check_model(body: Dict[str, Any], engine: Engine) -> None:
    model = body.get("model")
    if model is not None and model != engine.model_id:
        raise RequestError(
            404,
            f"the model {model!r} does not exist; this server serves {engine.model_id!r}",
            code="model_not_found",
        )


def sampling(body: Dict[str, Any], room: int, cap: int, token_key: str = "max_tokens") -> Sampling:
    """The sampling parameters of a request whose prompt leaves ``room`` tokens of context; ``cap`` is
    the server's --max-tokens. Without max_tokens the reply may use min(room, cap)."""
    limit = min(room, cap)
    name = token_key if body.get(token_key) is not None else "max_tokens"
    max_tokens = _integer(body, name, limit, 1, cap)
    assert max_tokens is not None
    if max_tokens > room:
        raise RequestError(
            400,
            f"{name} {max_tokens} does not fit: the prompt leaves {room} tokens of the model's context",
            param=name,
            code="context_length_exceeded",
        )
    seed = _integer(body, "seed", None, 0, 2**63 - 1)
    decoding = SamplingOptions(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        seed=secrets.randbits(63) if seed is None else seed,
    )
    return Sampling(decoding, tuple(_stops(body)))


def choices(body: Dict[str, Any]) -> int:
    n = _integer(body, "n", 1, 1, MAX_N)
    assert n is not None
    return n


def stream_flag(body: Dict[str, Any]) -> bool:
    value = body.get("stream", False)
    if not isinstance(value, bool):
        raise RequestError(400, "stream must be true or false", param="stream")
    return value


def messages(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The chat messages, with content given as a string or as a list of text parts (joined); the roles
    and the other contents as the request gave them (the engine checks them)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be an object", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts: List[Any] = [
                p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"
            ]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                raise RequestError(
                    400, f"messages[{i}].content: only text parts are supported", param="messages"
                )
            content = "".join(parts)
        out.append({"role": m.get("role"), "content": content})
    return out


def prompt_text(body: Dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError(400, "prompt must be a string (one prompt per request)", param="prompt")
    return prompt
