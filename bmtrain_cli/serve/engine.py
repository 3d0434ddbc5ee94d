"""One loaded model behind the server and the terminal chat: messages or text to prompt ids (the model's
chat template, as `bmtrain generate --chat`), request bounds against the context, and generation through
``models.generate`` / the scheduler's batched steps (both picking tokens with ``models.decoding``) with a
token callback that turns ids into streamed text and
applies stop strings. Generations go to the continuous-batching scheduler (serve/batching.py), which
decodes concurrent requests together; ``acquire`` bounds how many may run or wait."""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from bmtrain_cli.data.formats import BadRecord, parse_chat
from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.serve.batching import Job, Scheduler

OnText = Optional[Callable[[str], None]]  # gets each streamed text delta
Ask = Callable[[], bool]  # asked before every decode step: stop this reply?


def _no() -> bool:
    return False


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param: Optional[str] = extra.get("param")
        self.code: Optional[str] = extra.get("code")

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Sampling:
    """A request's decoding options (its max_tokens as ``max_new_tokens``; the end-of-sequence token is
    the tokenizer's, the engine sets it) and its stop strings."""

    decoding: SamplingOptions
    stop: Tuple[str, ...] = ()

    def but(self, **changes: Any) -> Sampling:
        """The same request with some decoding options changed (``seed``, ``max_new_tokens``)."""
        return replace(self, decoding=replace(self.decoding, **changes))


@dataclass
class Result:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


class TextStream:
    """Token ids in, text deltas out, decoding incrementally: each new token decodes a short window
    (the ids since the last emitted piece, with the piece before them for context, so a tokenizer that
    drops a leading space or merges bytes sees what it would in the whole text), never the whole reply.
    Holds back an unfinished UTF-8 sequence and anything that could still become a stop string, and
    cuts the text at the first stop string (searching only the new tail)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str], on_text: Optional[Callable[[str], None]]) -> None:
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.on_text = on_text
        self.ids: List[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] decode to the text's last piece
        self._read = 0
        self._searched = 0  # the text before this index holds no stop string

    def _emit(self, upto: int) -> None:
        if upto > self.sent:
            if self.on_text is not None:
                self.on_text(self.text[self.sent : upto])
            self.sent = upto

    def push(self, token: int) -> bool:
        """Add one new token (not EOS); True once a stop string has appeared."""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self._prefix : self._read])
        after = self.tok.decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return False  # a multi-byte character still being spelled out in byte tokens, or no text yet
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        lo = max(self._searched - self.hold, 0)
        self._searched = len(self.text)
        cuts = [i for i in (self.text.find(s, lo) for s in self.stop) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
            self.stopped = True
            self._emit(len(self.text))
            return True
        self._emit(len(self.text) - self.hold)
        return False

    def finish(self) -> str:
        if not self.stopped:
            self.text = self.tok.decode(self.ids)
        self._emit(len(self.text))
        return self.text


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        model_id: str,
        template: str = "auto",
        max_queue: int = 64,
        max_batch: int = 32,
    ):
        from bmtrain_cli.data.encode import make_encoder

        self.model = model
        self.tok = tokenizer
        self.model_id = model_id
        self.encoder = make_encoder(tokenizer, template)
        self.context = int(model.arch.max_position_embeddings)
        self.max_queue = max_queue
        self.scheduler = Scheduler(model, max_batch)
        self._count_lock = threading.Lock()
        self._pending = 0

    # ------------------------------------------------------------------ prompts
    def text_ids(self, prompt: str) -> List[int]:
        """A raw prompt encoded as `bmtrain generate --prompt` does (BOS when the tokenizer adds one)."""
        ids = list(self.tok.encode(prompt))
        if getattr(self.tok, "add_bos", False) and self.tok.bos_id is not None:
            ids = [self.tok.bos_id, *ids]
        return ids

    def chat_ids(self, messages: List[Dict[str, Any]]) -> List[int]:
        """The chat template's prompt for ``messages`` (optional system first, then alternating
        user/assistant turns ending with a user turn), up to the assistant header."""
        if not messages or messages[-1].get("role") != "user":
            raise RequestError(400, "messages must end with a user message", param="messages")
        try:
            conv = parse_chat({"messages": [*messages, {"role": "assistant", "content": "-"}]})
        except BadRecord as exc:
            raise RequestError(400, f"messages: {exc}", param="messages") from None
        return self.encoder.encode_prompt(conv)

    def room(self, ids: Sequence[int]) -> int:
        """How many new tokens fit after ``ids`` in the model's context (RequestError when none)."""
        if not ids:
            raise RequestError(400, "the prompt encodes to no tokens", param="prompt")
        room = self.context - len(ids)
        if room <= 0:
            raise RequestError(
                400,
                f"the prompt has {len(ids)} tokens; this model's context is {self.context} tokens, "
                "leaving no room for a reply",
                code="context_length_exceeded",
            )
        return room

    # ------------------------------------------------------------------ running
    def acquire(self) -> None:
        """Take a place among the requests running or waiting; RequestError 503 when ``max_queue``
        are. Give it back with ``release``."""
        with self._count_lock:
            if self._pending >= self.max_queue:
                raise RequestError(
                    503, f"the server is busy ({self._pending} requests waiting); retry later", "server_error"
                )
            self._pending += 1

    def release(self) -> None:
        with self._count_lock:
            self._pending -= 1

    @contextmanager
    def admit(self) -> Iterator[None]:
        """A place in the queue for the duration of the block (see acquire)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def start(
        self, ids: List[int], sampling: Sampling, on_text: OnText = None, cancelled: Ask = _no
    ) -> Future[Result]:
        """Queue one reply for the scheduler; the future's result once it is done. ``on_text`` gets the
        text deltas (on the scheduler's thread); ``cancelled`` is asked before every step."""
        stream = TextStream(self.tok, sampling.stop, on_text)
        eos = self.tok.eos_id
        state = {"eos": False, "n": 0}

        def on_token(_row: int, token: int) -> bool:
            state["n"] += 1
            if eos is not None and token == eos:
                state["eos"] = True
                return True
            return stream.push(token) or cancelled()

        out: Future[Result] = Future()

        def finish(done: Future[None]) -> None:
            exc = done.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            text = stream.finish()
            reason = "stop" if state["eos"] or stream.stopped else "length"
            out.set_result(Result(text, len(ids), state["n"], reason))

        job = Job(ids, replace(sampling.decoding, eos_token_id=eos), on_token, cancelled)
        self.scheduler.submit(job).add_done_callback(finish)
        return out

    def run(self, ids: List[int], sampling: Sampling, on_text: OnText = None, cancelled: Ask = _no) -> Result:
        """Generate one reply and wait for it. An interrupt (Ctrl-C in `bmtrain chat`) stops the reply
        at the next step, waits until the scheduler has let it go, and is raised again."""
        stop = threading.Event()
        future = self.start(ids, sampling, on_text, lambda: stop.is_set() or cancelled())
        try:
            return future.result()
        except KeyboardInterrupt:
            stop.set()
            wait([future])
            raise
