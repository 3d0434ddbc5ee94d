"""Which assistant turns, and which parts of them, are trained (``train_config`` options).

A template renders one trainable piece per assistant turn, in order. :func:`apply_options` then takes
the loss off turns that ``mask_history`` (all but the last) or a per-message ``loss: false`` exclude, and
off the reasoning (``<think>...</think>``) when ``train_reasoning`` is false.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

if TYPE_CHECKING:
    from bmtrain_cli.data.formats import Conversation

Piece = Tuple[str, bool]  # as in data/templates.py: (text, trainable)

THINK_RE = re.compile(r"<think>.*?</think>[ \t\r\n]*", re.DOTALL)


@dataclass(frozen=True)
class RenderOptions:
    mask_history: bool = False  # train only the last assistant turn
    train_reasoning: bool = True  # the <think> part of assistant turns is trained
    enable_thinking: Optional[bool] = None  # passed to the chat template when set
    history_reasoning: str = "template"  # "template": the template's rule; "drop": earlier turns' removed

    def key(self) -> str:
        return repr(dataclasses.astuple(self))


DEFAULT = RenderOptions()


def options_of(train_config: Any) -> RenderOptions:
    """The options of a TrainConfig (defaults for fields it does not have)."""
    return RenderOptions(
        mask_history=bool(getattr(train_config, "mask_history", False)),
        train_reasoning=bool(getattr(train_config, "train_reasoning", True)),
        enable_thinking=getattr(train_config, "enable_thinking", None),
        history_reasoning=str(getattr(train_config, "history_reasoning", "template")),
    )


def prepare(conv: Conversation, options: RenderOptions) -> Conversation:
    """``history_reasoning: drop``: the reasoning of every assistant turn but the last is removed."""
    if options.history_reasoning != "drop":
        return conv
    last = max(i for i, (r, _) in enumerate(conv.messages) if r == "assistant")
    msgs = []
    extras = list(conv.extras)
    for i, (role, content) in enumerate(conv.messages):
        if role == "assistant" and i != last:
            content = THINK_RE.sub("", content)
            if extras:
                extras[i] = {k: v for k, v in extras[i].items() if k != "reasoning_content"}
        msgs.append((role, content))
    return dataclasses.replace(conv, messages=tuple(msgs), extras=tuple(extras))


def trained_turns(conv: Conversation, options: RenderOptions) -> List[bool]:
    """One flag per assistant turn: whether its loss counts."""
    flags = []
    for i, (role, _) in enumerate(conv.messages):
        if role == "assistant":
            extra = conv.extras[i] if conv.extras else {}
            flags.append(extra.get("loss", True) is not False)
    if options.mask_history and flags:
        flags = [False] * (len(flags) - 1) + [flags[-1]]
    return flags


def _split_reasoning(text: str) -> List[Piece]:
    out: List[Piece] = []
    pos = 0
    for m in THINK_RE.finditer(text):
        if m.start() > pos:
            out.append((text[pos : m.start()], True))
        out.append((m.group(0), False))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], True))
    return out


def apply_options(pieces: List[Piece], conv: Conversation, options: RenderOptions) -> List[Piece]:
    """The pieces with the loss taken off excluded turns and (``train_reasoning: false``) reasoning."""
    flags = trained_turns(conv, options)
    if all(flags) and options.train_reasoning:
        return pieces
    out: List[Piece] = []
    turn = 0
    for text, trainable in pieces:
        if not trainable:
            out.append((text, False))
            continue
        keep = flags[turn] if turn < len(flags) else True
        turn += 1
        if not keep:
            out.append((text, False))
        elif not options.train_reasoning:
            out.extend(_split_reasoning(text))
        else:
            out.append((text, True))
    return out
