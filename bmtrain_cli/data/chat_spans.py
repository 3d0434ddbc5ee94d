"""Where the assistant turns are in a chat template's rendering of a whole conversation.

The text fed to the model is the template's rendering of all messages (what ``apply_chat_template``
gives). Assistant turn i is found by rendering prefixes: messages[:i] with the generation prompt ends
where the turn starts, messages[:i+1] ends with the turn. Templates whose text for earlier turns depends
on later ones (Qwen3 drops the reasoning of turns before the last user query) are handled by looking the
turn up in the full text, with its reasoning block or without it.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Tuple

from bmtrain_cli.data.turns import THINK_RE
from bmtrain_cli.errors import UserError

Piece = Tuple[str, bool]
Render = Callable[[List[dict], bool], str]


def _unstable(builtins: Iterable[str]) -> UserError:
    return UserError(
        "the tokenizer's chat_template is not prefix-stable (rendering more messages changes earlier "
        "text), so assistant turns cannot be located; set train_config.template to a built-in "
        f"({', '.join(builtins)})"
    )


def _by_prefixes(msgs: List[dict], render: Render) -> List[Tuple[str, str]]:
    """(prompt up to turn i's start, text ending with turn i) per assistant turn."""
    out = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            out.append((render(msgs[:i], True), render(msgs[: i + 1], False)))
    return out


def locate_turns(msgs: List[dict], render: Render, builtins: Iterable[str]) -> List[Piece]:
    """The full rendering cut into untrained and trained pieces, one trained piece per assistant turn."""
    full = render(msgs, False)
    spans = _by_prefixes(msgs, render)
    pieces: List[Piece] = []
    done = ""
    stable = True
    for prompt, upto in spans:
        if not (prompt.startswith(done) and upto.startswith(prompt)):
            stable = False
            break
        pieces += [(prompt[len(done) :], False), (upto[len(prompt) :], True)]
        done = upto
    if stable and full.startswith(done):
        pieces.append((full[len(done) :], False))
        return [p for p in pieces if p[0]]
    return _search(full, spans, builtins)


def _search(full: str, spans: List[Tuple[str, str]], builtins: Iterable[str]) -> List[Piece]:
    pieces: List[Piece] = []
    pos = 0
    for prompt, upto in spans:
        if not upto.startswith(prompt):
            raise _unstable(builtins)
        body = upto[len(prompt) :]
        for cand in (body, THINK_RE.sub("", body, count=1)):
            j = full.find(cand, pos) if cand else -1
            if j != -1:
                break
        else:
            raise _unstable(builtins)
        pieces += [(full[pos:j], False), (cand, True)]
        pos = j + len(cand)
    pieces.append((full[pos:], False))
    return [p for p in pieces if p[0]]
