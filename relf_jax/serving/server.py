"""`relf-jax serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over the engines.

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as
server-sent events of ``chat.completion.chunk`` / ``text_completion`` objects ending with
``data: [DONE]``, with ``stream_options.include_usage``; or one JSON object), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Request fields (docs/openai_api.md lists each): model, messages (chat) or prompt (completions),
temperature, top_p, max_tokens (also ``max_completion_tokens``; omitted: the rest of the
context), stop, stop_token_ids, seed, n, stream, stream_options, frequency_penalty,
presence_penalty, logit_bias, logprobs / top_logprobs, and the extra parameters top_k, min_p,
repetition_penalty. A knob the request omits takes the checkpoint's generation default
(``generation_config.json``), then OpenAI's. Types are strict (``"1"`` is not a number); an
unknown field, or an OpenAI field the server does not implement (tools, response_format, echo,
suffix, best_of, ...) at a value that would change the reply, is a 400 that names it.
relf_jax extra body fields (the OpenAI client's ``extra_body``):

- ``generator``: which engine of the model answers ("ar", "standard", "nsd", "greedy", "bd",
  "relf"); default the model's first. ``speculative_k`` and ``nfe`` must match that engine's
  settings when given (they are fixed when the server starts: ``--k``, ``--nfe``);
- ``priority``: an int for the priority policy (higher first).

Bad input gets an OpenAI-style error object ``{"error": {"message", "type", "param",
"code"}}`` with a 4xx status: 400 invalid request (malformed JSON, wrong types, out-of-range
values, a prompt that does not fit the context), 404 unknown model, 413 body too large, 429
queue full (with ``Retry-After``), 503 shutting down. A client that disconnects mid-stream is
cancelled and its slot freed before the next step. On SIGTERM uvicorn stops accepting
connections, the running requests finish, then the batchers stop.
"""


import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from relf_jax.data.tokenizer import encode_prompt
from relf_jax.errors import UserError
from relf_jax.serving.batching import (
    Batcher,
    Event,
    GenerationRequest,
    QueueFull,
    ServerClosed,
)
from relf_jax.serving.chat import ChatTemplate, encode_chat
from relf_jax.serving.engine_api import LOGPROBS_TOP, Engine, RequestParams

MAX_BODY_BYTES = 1 << 20
MAX_N = 16  # choices per request
SEED_STRIDE = 0x9E3779B1  # choice i of a seeded request samples with seed + i * SEED_STRIDE (choice 0: the seed)
LOGPROB_FLOOR = -9999.0  # what JSON gets for a log-probability of -inf (a token the processors removed)

# OpenAI request fields this server does not implement: a 400 naming the field, unless the value
# given is the field's no-op (NO_OP)
UNIMPLEMENTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
                 "audio", "modalities", "prediction", "reasoning_effort", "web_search_options", "service_tier",
                 "suffix", "echo", "best_of")
NO_OP: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v == [], "functions": lambda v: v == [], "tool_choice": lambda v: v == "none",
    "function_call": lambda v: v == "none", "parallel_tool_calls": lambda v: v is False,
    "response_format": lambda v: v == {"type": "text"}, "modalities": lambda v: v == ["text"],
    "service_tier": lambda v: v in ("auto", "default"), "echo": lambda v: v is False, "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1}


def _dumps(obj) -> str:
    """JSON text, ASCII-only: a lone surrogate the client sent (echoed in an error) stays encodable."""
    return json.dumps(obj, ensure_ascii=True)


def _finite(x: float) -> float:
    return max(LOGPROB_FLOOR, x)


class _LogProbs:
    """OpenAI's logprobs objects from the batcher's entries (`Event.log_probs`): chat
    ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``;
    completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``
    (the top dict holds the sampled token too, as OpenAI's legacy API). Token strings are the
    tokenizer's decoding of the one id (a special token: its piece, e.g. ``<|im_end|>``)."""

    def __init__(self, tokenizer, chat: bool, top: int):
        self.tok, self.chat, self.top = tokenizer, chat, top
        self._names: dict[int, str] = {}

    def name(self, i: int) -> str:
        s = self._names.get(i)
        if s is None:  # a special token by its piece (the reply's text never shows it)
            special = i in (getattr(self.tok, "special_ids", None) or ()) and hasattr(self.tok, "id_to_piece")
            s = self._names[i] = self.tok.id_to_piece(i) if special else self.tok.decode([i])
        return s

    def _chat_entry(self, t: int, entry) -> dict:
        lp, top = entry
        s = self.name(t)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8", "surrogatepass")),
                "top_logprobs": [{"token": self.name(i), "logprob": _finite(v),
                                  "bytes": list(self.name(i).encode("utf-8", "surrogatepass"))}
                                 for i, v in top[:self.top]]}

    def _legacy(self, ids, entries, offset: int) -> tuple[dict, int]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(ids, entries):
            s = self.name(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(_finite(lp))
            tops = {self.name(i): _finite(v) for i, v in top[:self.top]}
            tops.setdefault(s, _finite(lp))
            out["top_logprobs"].append(tops)
            out["text_offset"].append(offset)
            offset += len(s)
        return out, offset

    def delta(self, ev, offset: int) -> tuple[dict, int]:
        """One event's logprobs object (and the completions' next text offset)."""
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(ev.token_ids, ev.log_probs)]}, offset
        return self._legacy(ev.token_ids, ev.log_probs, offset)

    def whole(self, events) -> dict:
        """The logprobs object of a whole reply from its events."""
        ids = [t for ev in events for t in ev.token_ids]
        entries = [e for ev in events for e in ev.log_probs]
        if self.chat:
            return {"content": [self._chat_entry(t, e) for t, e in zip(ids, entries)]}
        return self._legacy(ids, entries, 0)[0]


@dataclasses.dataclass
class ServedEngine:
    """One engine behind a model id: its batcher, template and fixed settings."""

    engine: Engine
    batcher: Batcher
    template: ChatTemplate
    generator: str
    settings: dict  # the engine's fixed settings a request may name (k, nfe)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def _error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class BodyLimit:
    """ASGI middleware: 413 for a request body over `limit` bytes (declared or streamed)."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    return await self._reject(send)
        seen = 0
        started = False

        async def guarded_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send):
        await _reject_too_large(send, self.limit)


async def _reject_too_large(send, limit: int) -> None:
    body = json.dumps(_error_body(f"request body exceeds {limit} bytes", "invalid_request_error",
                                  code="request_too_large")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


class RequestTimer:
    """ASGI middleware: the server-side seconds of each generation request, from the ASGI call
    to the last byte of its response (a stream included), summed into `totals` for /metrics.

    Set against the engine seconds (``relf_model_seconds_total``) it gives the server's own
    overhead: HTTP parsing, validation, the chat template, tokenising, queueing and streaming.
    """

    def __init__(self, app, totals: dict):
        self.app, self.totals = app, totals

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.totals["seconds"] += time.perf_counter() - t0
            self.totals["count"] += 1


class LeanRoutes:
    """The generation endpoints' valid requests, straight from the ASGI call to their handlers.

    FastAPI's path for a request crosses about twenty layers (its middlewares, the router, the
    dependency solver, body parsing, validation); at batch 1 that is a measurable part of the
    server's own time. This path does the same work in one place for a POST to a generation
    endpoint with a JSON body: read the body (at most `limit` bytes), ``json.loads``, validate
    with the endpoint's pydantic model, call the endpoint, send its response. Anything it does
    not take - another content type, a body that is not a JSON object, a validation error - is
    replayed through the FastAPI app, whose handlers answer it, so errors are the same whichever
    path a request starts on. `APIError` raised by an endpoint gets `error_response`'s answer,
    as in the app. Requests served here are timed into `totals` like `RequestTimer`'s.
    """

    def __init__(self, routes: dict, error_response: Callable, totals: dict, limit: int):
        from starlette.requests import Request

        self.routes, self.error_response, self.totals, self.limit = routes, error_response, totals, limit
        self.request_cls = Request

    def takes(self, scope) -> bool:
        return scope["type"] == "http" and scope.get("method") == "POST" and scope.get("path") in self.routes

    async def __call__(self, scope, receive, send, fallback):
        t0 = time.perf_counter()
        ctype = length = None
        for name, value in scope.get("headers", ()):
            if name == b"content-type":
                ctype = value
            elif name == b"content-length":
                length = value
        if ctype is None or ctype.split(b";", 1)[0].strip().lower() != b"application/json" or (
                length is not None and not (length.isdigit() and int(length) <= self.limit)):
            return await fallback(scope, receive, send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                return await _reject_too_large(send, self.limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        model, endpoint = self.routes[scope["path"]]
        try:
            obj = json.loads(body)
            parsed = model.model_validate(obj) if isinstance(obj, dict) else None
        except (ValueError, RecursionError):  # bad JSON (a ValueError, as pydantic's ValidationError is)
            parsed = None
        if parsed is None:
            return await fallback(scope, _replay(body, receive), send)
        try:
            response = await endpoint(parsed, self.request_cls(scope, receive))
        except APIError as exc:
            response = self.error_response(exc)
        try:
            await response(scope, receive, send)
        finally:
            self.totals["seconds"] += time.perf_counter() - t0
            self.totals["count"] += 1


class _Last(str):
    """The final piece of an event stream (`create_app`'s ``EventStream`` ends the body with it)."""


def _replay(body: bytes, receive):
    """An ASGI receive that gives `body` (already read) first, then defers to `receive`."""
    given = False

    async def again():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def create_app(models: dict[str, list[ServedEngine]], *, retry_after_s: int = 1, max_body: int = MAX_BODY_BYTES,
               lean: bool = True):
    """The FastAPI app serving `models` (model id -> its engines; the first is the default).

    lean: valid generation requests skip FastAPI's own stack (`LeanRoutes`); ``False`` sends
    every request through it (the same answers, a little slower per request).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    if not models:
        raise UserError("the server needs at least one model")

    class EventStream(StreamingResponse):
        """A server-sent event stream over `events`, the asyncio queue its request's batcher
        feeds. One watcher task per stream waits for the client's disconnect, then calls
        `on_disconnect` (the batcher's cancel: a queued request leaves the queue at once, a
        running one frees its slot before the next step) and puts None into the queue, which
        ends the stream. Starlette's own streaming response watches with a task group per
        response, measurably slower per request at batch 1. The stream's last piece ends the
        body in the same write (`_Last`)."""

        def __init__(self, content, events: asyncio.Queue, on_disconnect: Callable[[], None], **kw):
            super().__init__(content, **kw)
            self.events, self.on_disconnect = events, on_disconnect

        async def stream_response(self, send):
            # The last piece of the stream (a `_Last`) ends the body in the same write; Starlette's
            # version ends it with an empty chunk, one more write and client wake-up per request.
            # The headers go out at once: a queued request's client knows it was accepted.
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for piece in self.body_iterator:
                last = isinstance(piece, _Last)
                await send({"type": "http.response.body", "body": piece.encode(self.charset), "more_body": not last})
                if last:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def __call__(self, scope, receive, send):
            async def watch():
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.on_disconnect()  # at once: the request's queue place or slot is free for the next
                self.events.put_nowait(None)

            watcher = asyncio.ensure_future(watch())
            try:
                await self.stream_response(send)
            finally:
                watcher.cancel()

    strict = ConfigDict(strict=True, extra="forbid")

    class Message(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, tool_call_id: the template's
        role: str
        content: str | list[dict[str, Any]] | None = None

    class StreamOptions(BaseModel):
        model_config = strict
        include_usage: bool = False

    class Common(BaseModel):
        model_config = strict
        model: str = Field(..., examples=list(models))
        temperature: float | None = Field(None, ge=0, le=100)
        top_p: float | None = Field(None, gt=0, le=1)
        max_tokens: int | None = Field(None, ge=1)
        stop: str | list[str] | None = None
        seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 63 - 1)
        stream: bool = False
        stream_options: StreamOptions | None = None
        n: int = Field(1, ge=1, le=MAX_N)
        frequency_penalty: float | None = Field(None, ge=-2, le=2)
        presence_penalty: float | None = Field(None, ge=-2, le=2)
        logit_bias: dict[str, float] | None = None
        # extra parameters (vLLM's names): top_k -1 or 0 is off
        top_k: int | None = Field(None, ge=-1)
        min_p: float | None = Field(None, ge=0, le=1)
        repetition_penalty: float | None = Field(None, gt=0)
        stop_token_ids: list[int] | None = None
        # no effect on the reply
        user: str | None = None
        metadata: dict[str, str] | None = None
        store: bool | None = None
        # relf_jax's own
        generator: str | None = None
        speculative_k: int | None = Field(None, ge=1)
        nfe: int | None = Field(None, ge=1)
        priority: int = Field(0, ge=-(2 ** 31), le=2 ** 31 - 1)
        # OpenAI fields this server does not implement: refused by name unless at their no-op value
        tools: Any = None
        tool_choice: Any = None
        functions: Any = None
        function_call: Any = None
        parallel_tool_calls: Any = None
        response_format: Any = None
        audio: Any = None
        modalities: Any = None
        prediction: Any = None
        reasoning_effort: Any = None
        web_search_options: Any = None
        service_tier: Any = None
        suffix: Any = None
        echo: Any = None
        best_of: Any = None

    class ChatRequest(Common):
        messages: list[Message] = Field(..., min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)
        logprobs: bool | None = None
        top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_TOP)

    class CompletionRequest(Common):
        prompt: str | list[str]
        logprobs: int | None = Field(None, ge=0, le=LOGPROBS_TOP)

    class App(FastAPI):
        """FastAPI, with the generation endpoints' valid requests taken by `LeanRoutes` first."""

        lean: LeanRoutes | None = None

        async def __call__(self, scope, receive, send):
            if self.lean is not None and self.lean.takes(scope):
                return await self.lean(scope, receive, send, super().__call__)
            return await super().__call__(scope, receive, send)

    app = App(title="relf_jax", version="0.1.0",
              description="OpenAI-compatible chat and completions over relf_jax generators.")
    app.state.models = models
    app.state.http_totals = {"seconds": 0.0, "count": 0}
    # response ids: unique per server process (a random prefix) without a uuid4 per request
    id_prefix, id_counter = secrets.token_hex(6), itertools.count()
    app.add_middleware(BodyLimit, limit=max_body)
    app.add_middleware(RequestTimer, totals=app.state.http_totals)  # added last: the outermost

    class AsciiJSON(JSONResponse):
        def render(self, content) -> bytes:
            return _dumps(content).encode("ascii")

    def error_response(exc: APIError) -> JSONResponse:
        return AsciiJSON(_error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                         headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "request body is not valid JSON"
        elif first.get("type") == "extra_forbidden":
            msg = "unknown field: not part of the API this server implements"
        return AsciiJSON(_error_body(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", "invalid_request_error",
                                     param=".".join(loc) or None), status_code=400)

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), kind), status_code=exc.status_code)

    def pick(body: Common) -> ServedEngine:
        served = models.get(body.model)
        if served is None:
            raise APIError(404, f"model {body.model!r} does not exist; served: {', '.join(models)}",
                           type="not_found_error", param="model", code="model_not_found")
        choice = served
        if body.generator is not None:
            choice = [s for s in served if s.generator == body.generator]
            if not choice:
                raise APIError(400, f"model {body.model!r} is not served with generator {body.generator!r}; "
                                    f"served: {', '.join(s.generator for s in served)}", param="generator")
        for name in ("speculative_k", "nfe"):
            want = getattr(body, name)
            if want is None:
                continue
            key = {"speculative_k": "k", "nfe": "nfe"}[name]
            match = [s for s in choice if s.settings.get(key) == want]
            if not match:
                have = sorted({s.settings.get(key) for s in choice if key in s.settings})
                raise APIError(400, f"{name}={want} is not served for model {body.model!r} "
                                    f"(served: {have or 'none'}; set at server start)", param=name)
            choice = match
        return choice[0]

    def params_of(body: Common, max_tokens: int | None, prompt_len: int, served: ServedEngine,
                  logprobs: int | None) -> list[RequestParams]:
        """The request's settings, one per choice (n); omitted knobs take the checkpoint's
        generation defaults (`generation_config.json`), then OpenAI's."""
        engine = served.engine
        defaults = dict(getattr(engine.tokenizer, "generation_defaults", None) or {})

        def knob(name, fallback):
            value = getattr(body, name)
            return defaults.get(name, fallback) if value is None else value

        if max_tokens is None:  # the rest of the context, as vLLM
            max_tokens = engine.max_context - engine.reserve() - prompt_len
            if max_tokens < 1:
                raise APIError(400, f"the prompt of {prompt_len} tokens fills the model context of "
                                    f"{engine.max_context - engine.reserve()} tokens", param="messages")
        bias = []
        for key, value in (body.logit_bias or {}).items():
            try:
                tok = int(key)
            except ValueError:
                raise APIError(400, f"logit_bias keys are token ids, got {key!r}", param="logit_bias") from None
            bias.append((tok, float(value)))
        top_k = knob("top_k", 0)
        base = secrets.randbits(31) if body.seed is None else int(body.seed) % (2 ** 31)
        try:
            return [RequestParams(
                max_tokens=max_tokens, temperature=float(knob("temperature", 1.0)), top_p=float(knob("top_p", 1.0)),
                seed=(base + i * SEED_STRIDE) % (2 ** 31) if body.seed is not None or i == 0 else secrets.randbits(31),
                top_k=0 if top_k in (-1, None) else int(top_k), min_p=float(knob("min_p", 0.0)),
                repetition_penalty=float(knob("repetition_penalty", 1.0)),
                frequency_penalty=float(body.frequency_penalty or 0.0),
                presence_penalty=float(body.presence_penalty or 0.0), logit_bias=tuple(bias), logprobs=logprobs,
                stop_token_ids=tuple(body.stop_token_ids or ())) for i in range(body.n)]
        except UserError as e:
            raise APIError(400, str(e)) from e

    def refuse_unimplemented(body: Common) -> None:
        """400 naming the first OpenAI field this server does not implement (given at a value
        that would change the reply)."""
        for name in UNIMPLEMENTED:
            value = getattr(body, name, None)
            if value is None or NO_OP.get(name, lambda v: False)(value):
                continue
            raise APIError(400, f"'{name}' is not implemented by this server", param=name, code="unsupported_field")

    def stops_of(body: Common) -> tuple[str, ...]:
        stop = body.stop
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stops) > 4:
            raise APIError(400, "at most 4 stop sequences", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop sequences must be non-empty", param="stop")
        return stops

    def submit(served: ServedEngine, req: GenerationRequest, sink: Callable[[Event], None]) -> str:
        try:
            return served.batcher.submit(req, sink)
        except QueueFull as e:
            raise APIError(429, "the request queue is full; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(retry_after_s)}) from e
        except ServerClosed as e:
            raise APIError(503, "the server is shutting down", type="server_error") from e
        except UserError as e:
            raise APIError(400, str(e)) from e

    async def run(request: Request, served: ServedEngine, reqs: list[GenerationRequest], *, chat: bool, stream: bool,
                  include_usage: bool, model: str, top_logprobs: int | None):
        """Submit the request's n choices and answer with their events (one JSON object, or a
        stream whose chunks carry each choice's index)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        tok = served.engine.tokenizer

        def sink(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
                pass

        rids: list[str] = []

        def cancel_all() -> None:
            for rid in rids:
                served.batcher.cancel(rid)

        try:
            for req in reqs:
                if served.batcher.cost_fn is not None and not req.predicted:
                    # the SJF cost predictor runs a model: off the event loop, so other streams keep flowing
                    rids.append(await asyncio.to_thread(submit, served, req, sink))
                else:
                    rids.append(submit(served, req, sink))
        except APIError:
            cancel_all()
            raise
        index = {rid: i for i, rid in enumerate(rids)}
        created = int(time.time())
        oid = ("chatcmpl-" if chat else "cmpl-") + f"{id_prefix}{next(id_counter):012x}"
        kind = "chat.completion" if chat else "text_completion"
        lp_format = _LogProbs(tok, chat, top_logprobs) if top_logprobs is not None else None

        def usage_of(finals: list[Event]) -> dict:
            us = [ev.usage or {} for ev in finals]
            prompt = us[0].get("prompt_tokens", 0) if us else 0
            completion = sum(u.get("completion_tokens", 0) for u in us)
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

        def reason(ev: Event) -> str:
            return "length" if ev.finish_reason == "length" else "stop"

        def failed(ev: Event) -> bool:
            return ev.finish_reason in ("error", "cancelled")

        if not stream:
            texts: list[list[str]] = [[] for _ in reqs]
            lps: list[list[Event]] = [[] for _ in reqs]
            finals: list[Event | None] = [None] * len(reqs)
            try:
                while any(f is None for f in finals):
                    try:
                        ev = await asyncio.wait_for(events.get(), timeout=0.5)
                    except TimeoutError:
                        if await request.is_disconnected():
                            return None
                        continue
                    i = index[ev.request_id]
                    texts[i].append(ev.text)
                    if ev.log_probs:
                        lps[i].append(ev)
                    if ev.finish_reason is not None:
                        finals[i] = ev
                        if failed(ev):
                            break
            finally:
                cancel_all()
            for ev in finals:
                if ev is not None and ev.finish_reason == "error":
                    raise APIError(500, ev.error or "generation failed", type="server_error")
                if ev is not None and ev.finish_reason == "cancelled":
                    raise APIError(503, "the request was cancelled (server shutting down)", type="server_error")
            choices = []
            for i, ev in enumerate(finals):
                body = "".join(texts[i])
                logprobs = lp_format.whole(lps[i]) if lp_format is not None else None
                choices.append({"index": i, "message": {"role": "assistant", "content": body}, "logprobs": logprobs,
                                "finish_reason": reason(ev)} if chat else
                               {"index": i, "text": body, "logprobs": logprobs, "finish_reason": reason(ev)})
            return JSONResponse({"id": oid, "object": kind, "created": created, "model": model,
                                 "choices": choices, "usage": usage_of(finals), "system_fingerprint": None})

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = [0] * len(reqs)  # completions: text offset of each choice's next token

        def chunk(i: int, delta: str | None, finish: str | None, first: bool = False, ev: Event | None = None) -> str:
            logprobs = None
            if lp_format is not None and ev is not None and ev.log_probs:
                logprobs, offsets[i] = lp_format.delta(ev, offsets[i])
            if chat:
                d: dict = {}
                if first:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                choice = {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
            obj = {"id": oid, "object": chunk_kind, "created": created, "model": model, "choices": [choice]}
            if include_usage:
                obj["usage"] = None
            return f"data: {_dumps(obj)}\n\n"

        async def sse():
            # Events that are ready together go out in one write: the role chunk with the first
            # text, the last text with the finish chunk, usage and [DONE] (each write wakes the
            # client and crosses the ASGI stack; at batch 1 that is server overhead).
            pending = [chunk(i, "", None, first=True) for i in range(len(reqs))] if chat else []
            finals: list[Event | None] = [None] * len(reqs)
            error = None
            try:
                while error is None and any(f is None for f in finals):
                    ev = await events.get()
                    while ev is not None:  # and every event already queued behind it
                        i = index[ev.request_id]
                        if ev.text or ev.log_probs:
                            pending.append(chunk(i, ev.text, None, ev=ev))
                        if ev.finish_reason is not None:
                            finals[i] = ev
                            if failed(ev):
                                error = ev
                                break
                            pending.append(chunk(i, None if chat else "", reason(ev)))
                        if events.empty():
                            break
                        ev = events.get_nowait()
                    if ev is None:  # the client went away (`EventStream`)
                        return
                    if pending and error is None and any(f is None for f in finals):
                        yield "".join(pending)
                        pending = []
                if error is not None:
                    err = _error_body(error.error or "the request was cancelled", "server_error")
                    pending.append(f"data: {_dumps(err)}\n\n")
                elif include_usage:
                    obj = {"id": oid, "object": chunk_kind, "created": created, "model": model,
                           "choices": [], "usage": usage_of(finals)}
                    pending.append(f"data: {_dumps(obj)}\n\n")
                pending.append("data: [DONE]\n\n")
                yield _Last("".join(pending))
            finally:  # the client went away (or we are done): free the slots now
                cancel_all()

        return EventStream(sse(), events, cancel_all, media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        refuse_unimplemented(body)
        served = pick(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        try:
            prompt = encode_chat(served.engine.tokenizer, served.template,
                                 [m.model_dump(exclude_none=False) for m in body.messages])
        except UserError as e:
            raise APIError(400, str(e), param="messages") from e
        stops = stops_of(body)
        reqs = [GenerationRequest(prompt=prompt, params=p, stop=stops, priority=body.priority)
                for p in params_of(body, max_tokens, len(prompt), served, top)]
        include = bool(body.stream_options and body.stream_options.include_usage)
        out = await run(request, served, reqs, chat=True, stream=body.stream, include_usage=include, model=body.model,
                        top_logprobs=top)
        return out if out is not None else JSONResponse({}, status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        refuse_unimplemented(body)
        served = pick(body)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise APIError(400, "prompt must be a string (or a list of one string)", param="prompt")
            prompt = prompt[0]
        try:
            ids = encode_prompt(served.engine.tokenizer, prompt)
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from e
        stops = stops_of(body)
        reqs = [GenerationRequest(prompt=ids, params=p, stop=stops, priority=body.priority)
                for p in params_of(body, body.max_tokens, len(ids), served, body.logprobs)]
        include = bool(body.stream_options and body.stream_options.include_usage)
        out = await run(request, served, reqs, chat=False, stream=body.stream, include_usage=include,
                        model=body.model, top_logprobs=body.logprobs)
        return out if out is not None else JSONResponse({}, status_code=499)

    if lean:
        app.lean = LeanRoutes({"/v1/chat/completions": (ChatRequest, chat_completions),
                               "/v1/completions": (CompletionRequest, completions)},
                              error_response, app.state.http_totals, max_body)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "relf_jax",
             "generators": [s.generator for s in served], "context_length": served[0].engine.max_context}
            for name, served in models.items()]}

    @app.get("/health")
    async def health():
        dead = [s.engine.name for served in models.values() for s in served if s.batcher.error is not None]
        if dead:
            return JSONResponse({"status": "error", "failed_engines": dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(prometheus_text(models, app.state.http_totals), media_type="text/plain; version=0.0.4")

    return app


def prometheus_text(models: dict[str, list[ServedEngine]], http_totals: dict | None = None) -> str:
    """Prometheus exposition text: queue length, slots, TTFT, tokens, tokens/s, acceptance length,
    and the server-side seconds of generation requests (`RequestTimer`)."""
    lines: list[str] = []

    def metric(name: str, kind: str, doc: str, samples: list[tuple[dict, float]]):
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
            v = "+Inf" if value == math.inf else repr(float(value))
            lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")

    served = [(name, s) for name, ss in models.items() for s in ss]

    def each(fn):
        return [({"model": n, "generator": s.generator}, fn(s)) for n, s in served]

    metric("relf_queue_length", "gauge", "Requests waiting for a slot.", each(lambda s: s.batcher.queue_length()))
    metric("relf_active_slots", "gauge", "Slots holding a request.", each(lambda s: s.batcher.active()))
    metric("relf_slots", "gauge", "Slots of the engine.", each(lambda s: s.engine.num_slots))
    metric("relf_requests_total", "counter", "Finished requests by finish reason.",
           [({"model": n, "generator": s.generator, "reason": r}, c)
            for n, s in served for r, c in s.batcher.stats.requests.items()])
    metric("relf_rejected_total", "counter", "Requests refused with 429 (queue full).",
           each(lambda s: s.batcher.stats.rejected))
    metric("relf_generated_tokens_total", "counter", "Tokens generated.", each(lambda s: s.batcher.stats.tokens))
    metric("relf_tokens_per_second", "gauge", "Generated tokens per second since start.",
           each(lambda s: s.batcher.stats.tokens / max(time.monotonic() - s.batcher.stats.started, 1e-9)))
    metric("relf_model_seconds_total", "counter", "Seconds spent in engine prefill and steps.",
           each(lambda s: s.batcher.stats.model_s))
    metric("relf_engine_steps_total", "counter", "Engine generate steps.", each(lambda s: s.batcher.stats.steps))
    metric("relf_overlapped_steps_total", "counter",
           "Engine steps started before the host work on the previous step (timed as model seconds only "
           "while the step was still running).", each(lambda s: s.batcher.stats.overlapped))
    metric("relf_overlapped_steps_ready_early_total", "counter",
           "Overlapped steps that had already finished when collected (their host work counted as overhead).",
           each(lambda s: s.batcher.stats.ready_early))
    metric("relf_acceptance_length", "gauge",
           "Mean tokens a request gains per step (speculative: accepted drafts + 1).",
           each(lambda s: s.batcher.stats.tokens / max(s.batcher.stats.slot_steps, 1)))
    metric("relf_accepted_draft_tokens_total", "counter", "Speculative draft tokens accepted.",
           each(lambda s: s.batcher.stats.accepted))
    lines.append("# HELP relf_ttft_seconds Time to first token.")
    lines.append("# TYPE relf_ttft_seconds histogram")
    for n, s in served:
        st = s.batcher.stats
        lab = f'model="{n}",generator="{s.generator}"'
        for b, c in st.ttft_buckets.items():
            le = "+Inf" if b == math.inf else repr(b)
            lines.append(f'relf_ttft_seconds_bucket{{{lab},le="{le}"}} {c}')
        lines.append(f"relf_ttft_seconds_sum{{{lab}}} {st.ttft_sum!r}")
        lines.append(f"relf_ttft_seconds_count{{{lab}}} {st.ttft_count}")
    metric("relf_e2e_seconds_sum", "counter", "Summed end-to-end seconds of finished requests.",
           each(lambda s: s.batcher.stats.e2e_sum))
    metric("relf_e2e_seconds_count", "counter", "Finished requests counted in relf_e2e_seconds_sum.",
           each(lambda s: s.batcher.stats.e2e_count))
    if http_totals is not None:
        lines.append("# HELP relf_http_request_duration_seconds Server-side seconds of generation requests "
                     "(ASGI call to the last response byte).")
        lines.append("# TYPE relf_http_request_duration_seconds summary")
        lines.append(f"relf_http_request_duration_seconds_sum {float(http_totals['seconds'])!r}")
        lines.append(f"relf_http_request_duration_seconds_count {int(http_totals['count'])}")
    return "\n".join(lines) + "\n"


def serve(models: dict[str, list[ServedEngine]], *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", graceful_timeout_s: float | None = None, lean: bool = True) -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests finish, then the batchers stop.
    ``lean=False``: every request goes through FastAPI's whole stack (see `create_app`)."""
    import uvicorn

    class _Server(uvicorn.Server):
        """SIGINT/SIGTERM start the graceful shutdown; the process then exits normally (status 0)
        instead of re-raising the signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    app = create_app(models, lean=lean)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_timeout_s)
    server = _Server(config)
    try:
        server.run()
    finally:
        for served in models.values():
            for s in served:
                s.batcher.stop(drain=True, timeout=30.0)


def build_models(workdir: str | None, generators: list[str], *, model_name: str | None = None, slots: int = 8,
                 max_queue: int = 256, policy: str = "fcfs", aging: float = 0.05, template: ChatTemplate | None = None,
                 cost_fn=None, mock: bool = False, mock_step_s: float = 0.0, warmup: bool = True,
                 overlap: bool | None = None, **engine_kw) -> dict[str, list[ServedEngine]]:
    """Engines + batchers for `relf-jax serve`: one model id with one engine per generator.

    policy: "fcfs", "sjf" (shortest predicted DWS cost first, with `aging` cost-seconds per
    second waited; needs `cost_fn`, e.g. `relf_jax.dws.predictor.WorkloadCost`) or "priority"
    (the request's ``priority`` field, aging in levels per second). ``mock=True`` serves the
    model-free `MockEngine` (no checkpoint needed). `workdir` may be a HuggingFace folder (read in
    place, `relf_jax.workflows.load_model`). template: None serves the checkpoint's own chat
    template (`ChatTemplate.for_tokenizer`; the markers for a model without one). overlap:
    `Batcher`'s (the next engine step starts before the host work on the last one; None: the
    engine's default, on for the AR and speculative engines).
    """
    import os

    from relf_jax.serving.chat import load_engine
    from relf_jax.serving.engines import MockEngine
    from relf_jax.serving.scheduler import make_policy

    if policy == "sjf":
        if cost_fn is None:
            raise UserError("policy sjf ranks by predicted DWS cost: give a DWS predictor (--dws-predictor) "
                            "and its cost model (--dws-cost-model)")
        pol = make_policy("sjf:dws_cost", aging=aging)
    elif policy == "priority":
        pol = make_policy("priority", aging=aging)
    elif policy == "fcfs":
        pol = make_policy("fcfs")
    else:
        raise UserError(f"unknown policy {policy!r}; choose fcfs, sjf or priority")
    name = model_name or ("mock" if mock else os.path.basename(os.path.normpath(workdir or "model")))
    served = []
    for gen in generators or ["ar"]:
        if mock:
            engine = MockEngine(slots, step_s=mock_step_s)
            gen = "mock"
        else:
            if not workdir:
                raise UserError("serve needs --model (a HuggingFace folder or a run directory), --workdir or --mock")
            engine = load_engine(workdir, gen, slots=slots, **engine_kw)
        if warmup:  # compile every program the engine can run while serving (`Engine.warmup`)
            t0 = time.perf_counter()
            print(f"[serve] compiling the {gen} engine (a first start on CPU can take a minute; with "
                  "`relf_jax.jit_cache` on, as in `relf-jax serve`, later starts read it back)", file=sys.stderr,
                  flush=True)
            engine.warmup()
            print(f"[serve] {gen} engine compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        settings = {}
        if getattr(engine, "k", None) is not None and gen in ("standard", "nsd", "greedy"):
            settings["k"] = engine.k
        if gen == "relf":
            settings["nfe"] = engine.flow_settings.nfe
        batcher = Batcher(engine, pol, max_queue=max_queue, cost_fn=cost_fn, overlap=overlap).start()
        served.append(ServedEngine(engine=engine, batcher=batcher,
                                   template=template or ChatTemplate.for_tokenizer(engine.tokenizer),
                                   generator=gen, settings=settings))
    return {name: served}
