"""The ASGI layer under the app: the body-size limit, the generation requests' server-side
timer (`relf_http_request_duration_seconds`), and `LeanRoutes`, the short path of valid
generation requests past FastAPI's own stack.
"""

import json
import time
from collections.abc import Callable

from starlette.requests import Request

from relf_jax.serving.http.protocol import MAX_BODY_BYTES, APIError, error_body


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
        await reject_too_large(send, self.limit)


async def reject_too_large(send, limit: int) -> None:
    body = json.dumps(error_body(f"request body exceeds {limit} bytes", "invalid_request_error",
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
                return await reject_too_large(send, self.limit)
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
            return await fallback(scope, replay(body, receive), send)
        try:
            response = await endpoint(parsed, self.request_cls(scope, receive))
        except APIError as exc:
            response = self.error_response(exc)
        try:
            await response(scope, receive, send)
        finally:
            self.totals["seconds"] += time.perf_counter() - t0
            self.totals["count"] += 1


def replay(body: bytes, receive):
    """An ASGI receive that gives `body` (already read) first, then defers to `receive`."""
    given = False

    async def again():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
