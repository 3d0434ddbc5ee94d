"""`bmtrain chat`: an interactive terminal conversation over the engine: streamed replies, multi-turn
history through the chat template (the oldest turns dropped, with a note, when it outgrows the
context), /reset, /system TEXT, /exit; Ctrl-C stops the reply being written, not the session."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from bmtrain_cli.serve.engine import Engine, RequestError, Sampling

HELP = "commands: /reset (forget the conversation), /system TEXT (set the system prompt), /exit"


class ChatSession:
    def __init__(
        self, engine: Engine, sampling: Sampling, write: Callable[[str], None], note: Callable[[str], None]
    ):
        self.engine = engine
        self.sampling = sampling
        self.write = write
        self.note = note
        self.system: Optional[str] = None
        self.turns: List[Dict[str, str]] = []

    def _messages(self) -> List[Dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def _prompt(self) -> Optional[List[int]]:
        """Prompt ids of the conversation, dropping the oldest exchanges until a reply of max_tokens
        fits (at least one token must); None when even the last message alone does not fit."""
        dropped = 0
        while True:
            ids = self.engine.chat_ids(self._messages())
            if (
                self.engine.context - len(ids) >= min(self.sampling.decoding.max_new_tokens, 16)
                or len(self.turns) <= 1
            ):
                break
            self.turns = self.turns[2:]
            dropped += 1
        if dropped:
            self.note(
                f"[note: the conversation outgrew the {self.engine.context}-token context: "
                f"dropped the {dropped} oldest exchange(s)]"
            )
        if len(ids) >= self.engine.context:
            self.note(f"[the message is {len(ids)} tokens, over the {self.engine.context}-token context]")
            return None
        return ids

    def command(self, line: str) -> bool:
        """Handle a /command; False on /exit."""
        word, _, rest = line.partition(" ")
        if word == "/exit":
            return False
        if word == "/reset":
            self.turns = []
            self.note("[conversation reset]")
        elif word == "/system":
            self.system = rest.strip() or None
            self.turns = []
            self.note(f"[system prompt {'set' if self.system else 'cleared'}; conversation reset]")
        else:
            self.note(f"[unknown command {word}; {HELP}]")
        return True

    def reply(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})
        try:
            ids = self._prompt()
        except RequestError as exc:
            ids = None
            self.note(f"[{exc.message}]")
        if ids is None:
            self.turns.pop()
            return
        room = self.engine.context - len(ids)
        s = self.sampling.but(max_new_tokens=min(self.sampling.decoding.max_new_tokens, room))
        parts: List[str] = []

        def on_text(delta: str) -> None:
            parts.append(delta)
            self.write(delta)

        try:
            self.engine.run(ids, s, on_text)
        except KeyboardInterrupt:
            self.note("\n[stopped]")
        self.write("\n")
        answer = "".join(parts)
        if answer.strip():
            self.turns.append({"role": "assistant", "content": answer})
        else:
            self.turns.pop()  # nothing to keep: the question goes too, so turns still alternate


def run_chat(session: ChatSession, read: Callable[[], str]) -> None:
    """Read lines until /exit or end of input; ``read`` raises EOFError at the end."""
    session.note(f"[chatting with {session.engine.model_id}; {HELP}]")
    while True:
        try:
            line = read().strip()
        except EOFError:
            return
        except KeyboardInterrupt:
            session.note("\n[/exit or Ctrl-D to leave]")
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return
            continue
        session.reply(line)
