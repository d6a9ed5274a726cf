"""The FastAPI app of `relf-jax serve` (`create_app`) and the process that serves it (`serve`).

Endpoints: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (`Routes`), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text, `metrics.prometheus_text`).
"""

import asyncio
import contextlib
import itertools
import secrets
import signal
import threading
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from relf_jax.data.tokenizer import encode_prompt
from relf_jax.errors import UserError
from relf_jax.serving.batching import Event, GenerationRequest, QueueFull, ServerClosed
from relf_jax.serving.chat_template import encode_chat
from relf_jax.serving.http.asgi import BodyLimit, LeanRoutes, RequestTimer
from relf_jax.serving.http.metrics import prometheus_text
from relf_jax.serving.http.protocol import (
    MAX_BODY_BYTES,
    APIError,
    ChatRequest,
    Common,
    CompletionRequest,
    chat_max_tokens,
    chat_top_logprobs,
    completion_prompt,
    dumps,
    error_body,
    params_of,
    refuse_unimplemented,
    stops_of,
)
from relf_jax.serving.http.responses import AsciiJSON, EventStream, Last, LogProbs, Reply, failed, finish_reason
from relf_jax.serving.loading import ServedEngine


class App(FastAPI):
    """FastAPI, with the generation endpoints' valid requests taken by `LeanRoutes` first."""

    lean: LeanRoutes | None = None

    async def __call__(self, scope, receive, send):
        if self.lean is not None and self.lean.takes(scope):
            return await self.lean(scope, receive, send, super().__call__)
        return await super().__call__(scope, receive, send)


def error_response(exc: APIError) -> JSONResponse:
    return AsciiJSON(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                     headers=exc.headers)


async def on_api_error(request, exc: APIError):
    return error_response(exc)


async def on_validation_error(request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        msg = "request body is not valid JSON"
    elif first.get("type") == "extra_forbidden":
        msg = "unknown field: not part of the API this server implements"
    return AsciiJSON(error_body(f"{'.'.join(loc) + ': ' if loc else ''}{msg}", "invalid_request_error",
                                param=".".join(loc) or None), status_code=400)


async def on_http_error(request, exc: StarletteHTTPException):
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)


async def whole_events(request: Request, events: asyncio.Queue, index: dict[str, int]):
    """(texts, log-prob events, final event) per choice, once every choice finished or one
    failed; None when the client went away."""
    n = len(index)
    texts: list[list[str]] = [[] for _ in range(n)]
    lps: list[list[Event]] = [[] for _ in range(n)]
    finals: list[Event | None] = [None] * n
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
    return texts, lps, finals


def raise_failed(finals: list[Event | None]) -> None:
    for ev in finals:
        if ev is not None and ev.finish_reason == "error":
            raise APIError(500, ev.error or "generation failed", type="server_error")
        if ev is not None and ev.finish_reason == "cancelled":
            raise APIError(503, "the request was cancelled (server shutting down)", type="server_error")


async def event_stream(reply: Reply, events: asyncio.Queue, index: dict[str, int], cancel_all: Callable[[], None]):
    """The server-sent events of a streamed reply.

    Events that are ready together go out in one write: the role chunk with the first text, the
    last text with the finish chunk, usage and [DONE] (each write wakes the client and crosses
    the ASGI stack; at batch 1 that is server overhead)."""
    n, chat = len(index), reply.chat
    pending = [reply.chunk(i, "", None, first=True) for i in range(n)] if chat else []
    finals: list[Event | None] = [None] * n
    error = None
    try:
        while error is None and any(f is None for f in finals):
            ev = await events.get()
            while ev is not None:  # and every event already queued behind it
                i = index[ev.request_id]
                if ev.text or ev.log_probs:
                    pending.append(reply.chunk(i, ev.text, None, ev=ev))
                if ev.finish_reason is not None:
                    finals[i] = ev
                    if failed(ev):
                        error = ev
                        break
                    pending.append(reply.chunk(i, None if chat else "", finish_reason(ev)))
                if events.empty():
                    break
                ev = events.get_nowait()
            if ev is None:  # the client went away (`EventStream`)
                return
            if pending and error is None and any(f is None for f in finals):
                yield "".join(pending)
                pending = []
        if error is not None:
            err = error_body(error.error or "the request was cancelled", "server_error")
            pending.append(f"data: {dumps(err)}\n\n")
        elif reply.include_usage:
            pending.append(reply.usage_chunk(finals))
        pending.append("data: [DONE]\n\n")
        yield Last("".join(pending))
    finally:  # the client went away (or we are done): free the slots now
        cancel_all()


class Routes:
    """The endpoints over `models` (model id -> its engines; the first is the default)."""

    def __init__(self, models: dict[str, list[ServedEngine]], http_totals: dict, retry_after_s: int = 1):
        self.models, self.http_totals, self.retry_after_s = models, http_totals, retry_after_s
        # response ids: unique per server process (a random prefix) without a uuid4 per request
        self.id_prefix, self.id_counter = secrets.token_hex(6), itertools.count()

    def pick(self, body: Common) -> ServedEngine:
        """The engine that answers `body`: its model's, of its generator and fixed settings."""
        served = self.models.get(body.model)
        if served is None:
            raise APIError(404, f"model {body.model!r} does not exist; served: {', '.join(self.models)}",
                           type="not_found_error", param="model", code="model_not_found")
        choice = served
        if body.generator is not None:
            choice = [s for s in served if s.generator == body.generator]
            if not choice:
                raise APIError(400, f"model {body.model!r} is not served with generator {body.generator!r}; "
                                    f"served: {', '.join(s.generator for s in served)}", param="generator")
        for name, key in (("speculative_k", "k"), ("nfe", "nfe")):
            want = getattr(body, name)
            if want is None:
                continue
            match = [s for s in choice if s.settings.get(key) == want]
            if not match:
                have = sorted({s.settings.get(key) for s in choice if key in s.settings})
                raise APIError(400, f"{name}={want} is not served for model {body.model!r} "
                                    f"(served: {have or 'none'}; set at server start)", param=name)
            choice = match
        return choice[0]

    def submit(self, served: ServedEngine, req: GenerationRequest, sink: Callable[[Event], None]) -> str:
        try:
            return served.batcher.submit(req, sink)
        except QueueFull as e:
            raise APIError(429, "the request queue is full; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)}) from e
        except ServerClosed as e:
            raise APIError(503, "the server is shutting down", type="server_error") from e
        except UserError as e:
            raise APIError(400, str(e)) from e

    async def submit_all(self, served: ServedEngine, reqs: list[GenerationRequest], events: asyncio.Queue,
                         rids: list[str]) -> None:
        """Submit `reqs`, their events into `events` and their ids into `rids` (all cancelled on an error)."""
        loop = asyncio.get_running_loop()

        def sink(ev: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the event loop has closed (the server stopped): nobody is listening
                pass

        try:
            for req in reqs:
                if served.batcher.cost_fn is not None and not req.predicted:
                    # the SJF cost predictor runs a model: off the event loop, so other streams keep flowing
                    rids.append(await asyncio.to_thread(self.submit, served, req, sink))
                else:
                    rids.append(self.submit(served, req, sink))
        except APIError:
            for rid in rids:
                served.batcher.cancel(rid)
            raise

    async def respond(self, request: Request, served: ServedEngine, reqs: list[GenerationRequest], *, chat: bool,
                      stream: bool, include_usage: bool, model: str, top_logprobs: int | None):
        """Submit the request's n choices and answer with their events (one JSON object, or a
        stream whose chunks carry each choice's index)."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        rids: list[str] = []
        await self.submit_all(served, reqs, events, rids)

        def cancel_all() -> None:
            for rid in rids:
                served.batcher.cancel(rid)

        index = {rid: i for i, rid in enumerate(rids)}
        lp_format = LogProbs(served.engine.tokenizer, chat, top_logprobs) if top_logprobs is not None else None
        reply = Reply(("chatcmpl-" if chat else "cmpl-") + f"{self.id_prefix}{next(self.id_counter):012x}",
                      chat=chat, model=model, n=len(reqs), include_usage=include_usage, lp_format=lp_format)
        if stream:
            return EventStream(event_stream(reply, events, index, cancel_all), events, cancel_all,
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            got = await whole_events(request, events, index)
        finally:
            cancel_all()
        if got is None:
            return None
        raise_failed(got[2])
        return JSONResponse(reply.whole(*got))

    async def answer(self, request: Request, body: Common, served: ServedEngine, prompt: list[int], *, chat: bool,
                     max_tokens: int | None, top_logprobs: int | None):
        """The answer to a generation request whose prompt ids are `prompt` (499 when the client went away)."""
        stops = stops_of(body)
        reqs = [GenerationRequest(prompt=prompt, params=p, stop=stops, priority=body.priority)
                for p in params_of(body, max_tokens, len(prompt), served.engine, top_logprobs)]
        out = await self.respond(request, served, reqs, chat=chat, stream=body.stream,
                                 include_usage=body.include_usage, model=body.model, top_logprobs=top_logprobs)
        return out if out is not None else JSONResponse({}, status_code=499)

    async def chat_completions(self, body: ChatRequest, request: Request):
        refuse_unimplemented(body)
        served = self.pick(body)
        max_tokens = chat_max_tokens(body)
        top = chat_top_logprobs(body)
        try:
            prompt = encode_chat(served.engine.tokenizer, served.template,
                                 [m.model_dump(exclude_none=False) for m in body.messages])
        except UserError as e:
            raise APIError(400, str(e), param="messages") from e
        return await self.answer(request, body, served, prompt, chat=True, max_tokens=max_tokens, top_logprobs=top)

    async def completions(self, body: CompletionRequest, request: Request):
        refuse_unimplemented(body)
        served = self.pick(body)
        prompt = completion_prompt(body)
        try:
            ids = encode_prompt(served.engine.tokenizer, prompt)
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from e
        return await self.answer(request, body, served, ids, chat=False, max_tokens=body.max_tokens,
                                 top_logprobs=body.logprobs)

    async def list_models(self):
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "relf_jax",
             "generators": [s.generator for s in served], "context_length": served[0].engine.max_context}
            for name, served in self.models.items()]}

    async def health(self):
        dead = [s.engine.name for served in self.models.values() for s in served if s.batcher.error is not None]
        if dead:
            return JSONResponse({"status": "error", "failed_engines": dead}, status_code=503)
        return {"status": "ok"}

    async def metrics(self):
        return PlainTextResponse(prometheus_text(self.models, self.http_totals),
                                 media_type="text/plain; version=0.0.4")


def _model_examples(app: FastAPI, models: dict) -> Callable[[], dict]:
    """`app.openapi` with the served model ids as the examples of the requests' ``model`` field."""
    plain = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = plain()
            for name in ("ChatRequest", "CompletionRequest"):
                field = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
                if "model" in field:
                    field["model"]["examples"] = list(models)
        return app.openapi_schema

    return openapi


def create_app(models: dict[str, list[ServedEngine]], *, retry_after_s: int = 1, max_body: int = MAX_BODY_BYTES,
               lean: bool = True) -> App:
    """The FastAPI app serving `models` (model id -> its engines; the first is the default).

    lean: valid generation requests skip FastAPI's own stack (`LeanRoutes`); ``False`` sends
    every request through it (the same answers, a little slower per request).
    """
    if not models:
        raise UserError("the server needs at least one model")
    app = App(title="relf_jax", version="0.1.0",
              description="OpenAI-compatible chat and completions over relf_jax generators.")
    app.state.models = models
    app.state.http_totals = {"seconds": 0.0, "count": 0}
    app.add_middleware(BodyLimit, limit=max_body)
    app.add_middleware(RequestTimer, totals=app.state.http_totals)  # added last: the outermost
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    routes = Routes(models, app.state.http_totals, retry_after_s)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.post("/v1/completions")(routes.completions)
    if lean:
        app.lean = LeanRoutes({"/v1/chat/completions": (ChatRequest, routes.chat_completions),
                               "/v1/completions": (CompletionRequest, routes.completions)},
                              error_response, app.state.http_totals, max_body)
    app.get("/v1/models")(routes.list_models)
    app.get("/health")(routes.health)
    app.get("/metrics", response_class=PlainTextResponse)(routes.metrics)
    app.openapi = _model_examples(app, models)
    return app


class GracefulServer(uvicorn.Server):
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


def serve(models: dict[str, list[ServedEngine]], *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", graceful_timeout_s: float | None = None, lean: bool = True) -> None:
    """Run the server until SIGINT/SIGTERM; in-flight requests finish, then the batchers stop.
    ``lean=False``: every request goes through FastAPI's whole stack (see `create_app`)."""
    app = create_app(models, lean=lean)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout_s)
    server = GracefulServer(config)
    try:
        server.run()
    finally:
        for served in models.values():
            for s in served:
                s.batcher.stop(drain=True, timeout=30.0)
