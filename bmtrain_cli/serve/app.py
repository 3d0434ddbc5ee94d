"""The OpenAI-compatible HTTP API on Starlette: /v1/models, /v1/chat/completions, /v1/completions (both
with ``stream: true`` as server-sent events ending with ``data: [DONE]``), /health and the chat page at /.

Generations go to the engine's continuous-batching scheduler (serve/batching.py): concurrent requests,
and the n choices of one request, are decoded together. A client that disconnects (streaming or not)
cancels its generation at the next decode step."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bmtrain_cli.serve import requests as rq
from bmtrain_cli.serve.engine import Engine, RequestError, Result, Sampling
from bmtrain_cli.serve.page import CHAT_PAGE

MAX_BODY_BYTES = 1 << 20  # 1 MiB: prompts are bounded by the model's context anyway
OPEN_PATHS = ("/", "/health")
DISCONNECT_POLL_S = 0.1  # how often a non-streaming request checks whether its client is still there


def _error(exc: RequestError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_body(request: Request) -> Dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body is over the {MAX_BODY_BYTES} byte limit")
    chunks: List[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body is over the {MAX_BODY_BYTES} byte limit")
        chunks.append(chunk)
    return rq.parse_json(b"".join(chunks))


class Server:
    def __init__(self, engine: Engine, api_key: Optional[str] = None, max_tokens: int = 512) -> None:
        self.engine = engine
        self.api_key = api_key
        self.max_tokens = max_tokens
        self.created = int(time.time())

    # ------------------------------------------------------------------ plumbing
    def _authorized(self, request: Request) -> bool:
        if self.api_key is None or request.url.path in OPEN_PATHS:
            return True
        return request.headers.get("authorization", "") == f"Bearer {self.api_key}"

    async def _generate(
        self, ids: List[int], s: Sampling, cancel: threading.Event, on_text: Any = None
    ) -> Result:
        return await asyncio.wrap_future(self.engine.start(ids, s, on_text, cancel.is_set))

    def _usage(self, prompt: int, completion: int) -> Dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        stats = self.engine.scheduler.stats()
        return JSONResponse({"status": "ok", "model": self.engine.model_id, "batching": stats})

    async def page(self, request: Request) -> Response:
        return HTMLResponse(CHAT_PAGE)

    async def models(self, request: Request) -> Response:
        card = {"id": self.engine.model_id, "object": "model", "created": self.created, "owned_by": "bmtrain"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Response:
        body = await _read_body(request)
        rq.check_model(body, self.engine)
        ids = self.engine.chat_ids(rq.messages(body))
        return await self._complete(request, body, ids, chat=True)

    async def completions(self, request: Request) -> Response:
        body = await _read_body(request)
        rq.check_model(body, self.engine)
        ids = self.engine.text_ids(rq.prompt_text(body))
        return await self._complete(request, body, ids, chat=False)

    async def _complete(self, request: Request, body: Dict[str, Any], ids: List[int], chat: bool) -> Response:
        key = "max_completion_tokens" if chat else "max_tokens"
        sampling = rq.sampling(body, self.engine.room(ids), self.max_tokens, key)
        n, stream = rq.choices(body), rq.stream_flag(body)
        if stream and n > 1:
            raise RequestError(400, "stream: true takes n 1", param="n")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self.engine.acquire()  # now, so that a full queue is a 503 before the stream's 200 goes out
            return _QueuedStream(self._events(rid, ids, sampling, chat, usage), self.engine.release)
        cancel = threading.Event()
        with self.engine.admit():
            runs = [
                self._generate(ids, sampling.but(seed=sampling.decoding.seed + i), cancel) for i in range(n)
            ]
            results = await _unless_disconnected(request, asyncio.gather(*runs), cancel)
        return JSONResponse(self._full(rid, results, chat))

    def _full(self, rid: str, results: List[Result], chat: bool) -> Dict[str, Any]:
        choices = []
        for i, r in enumerate(results):
            if chat:
                choices.append(
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": r.text},
                        "finish_reason": r.finish_reason,
                    }
                )
            else:
                choices.append(
                    {"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
                )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.engine.model_id,
            "choices": choices,
            "usage": self._usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results)),
        }

    def _chunk(
        self, rid: str, chat: bool, delta: Optional[str], finish: Optional[str], role: bool = False
    ) -> str:
        if chat:
            d: Dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta is not None:
                d["content"] = delta
            choice: Dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        obj = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.engine.model_id,
            "choices": [choice],
        }
        return f"data: {json.dumps(obj)}\n\n"

    async def _events(
        self, rid: str, ids: List[int], s: Sampling, chat: bool, usage: bool
    ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def on_text(text: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, text)

        task = asyncio.ensure_future(self._generate(ids, s, cancel, on_text))
        task.add_done_callback(lambda _t: loop.call_soon_threadsafe(queue.put_nowait, None))
        try:
            if chat:
                yield self._chunk(rid, chat, None, None, role=True)
            while (text := await queue.get()) is not None:
                yield self._chunk(rid, chat, text, None)
            result = task.result()
            yield self._chunk(rid, chat, None, result.finish_reason)
            if usage:
                u = self._usage(result.prompt_tokens, result.completion_tokens)
                yield f"data: {json.dumps({'id': rid, 'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            cancel.set()  # the client went away (or we are done): stop generating


async def _unless_disconnected(request: Request, work: Any, cancel: threading.Event) -> Any:
    """The result of ``work``, cancelling its generations (``cancel``) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            cancel.set()  # the client left: the rows stop at the next step, the reply goes nowhere
        return await task
    finally:
        watch.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body has been read already)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


class _QueuedStream(StreamingResponse):
    """Server-sent events that give their queue place back once sent (or abandoned by the client)."""

    def __init__(self, events: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _handle(fn: Callable) -> Callable:
    """An endpoint whose RequestError becomes an OpenAI-style JSON error (and anything unexpected a
    JSON 500 without a traceback)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except RequestError as exc:
            return _error(exc)
        except Exception as exc:  # the server must answer, not die
            return _error(RequestError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

    return endpoint


def build_app(server: Server) -> Callable:
    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        return _error(
            RequestError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}", kind)
        )

    routes = [
        Route("/", _handle(server.page), methods=["GET"]),
        Route("/health", _handle(server.health), methods=["GET"]),
        Route("/v1/models", _handle(server.models), methods=["GET"]),
        Route("/v1/chat/completions", _handle(server.chat), methods=["POST"]),
        Route("/v1/completions", _handle(server.completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})

    async def auth(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not server._authorized(Request(scope)):
            err = RequestError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )
            await _error(err)(scope, receive, send)
            return
        await app(scope, receive, send)

    return auth
