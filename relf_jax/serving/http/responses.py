"""The response side of the generation endpoints: OpenAI's response and chunk objects
(`Reply`), their logprobs objects (`LogProbs`), and the server-sent event stream (`EventStream`).
"""

import asyncio
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse, StreamingResponse

from relf_jax.serving.batching import Event
from relf_jax.serving.http.protocol import dumps

LOGPROB_FLOOR = -9999.0  # what JSON gets for a log-probability of -inf (a token the processors removed)


def finite(x: float) -> float:
    return max(LOGPROB_FLOOR, x)


class LogProbs:
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
        return {"token": s, "logprob": finite(lp), "bytes": list(s.encode("utf-8", "surrogatepass")),
                "top_logprobs": [{"token": self.name(i), "logprob": finite(v),
                                  "bytes": list(self.name(i).encode("utf-8", "surrogatepass"))}
                                 for i, v in top[:self.top]]}

    def _legacy(self, ids, entries, offset: int) -> tuple[dict, int]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, (lp, top) in zip(ids, entries):
            s = self.name(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(finite(lp))
            tops = {self.name(i): finite(v) for i, v in top[:self.top]}
            tops.setdefault(s, finite(lp))
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


class AsciiJSON(JSONResponse):
    def render(self, content) -> bytes:
        return dumps(content).encode("ascii")


class Last(str):
    """The final piece of an event stream (`EventStream` ends the body with it)."""


class EventStream(StreamingResponse):
    """A server-sent event stream over `events`, the asyncio queue its request's batcher
    feeds. One watcher task per stream waits for the client's disconnect, then calls
    `on_disconnect` (the batcher's cancel: a queued request leaves the queue at once, a
    running one frees its slot before the next step) and puts None into the queue, which
    ends the stream. Starlette's own streaming response watches with a task group per
    response, measurably slower per request at batch 1. The stream's last piece ends the
    body in the same write (`Last`)."""

    def __init__(self, content, events: asyncio.Queue, on_disconnect: Callable[[], None], **kw):
        super().__init__(content, **kw)
        self.events, self.on_disconnect = events, on_disconnect

    async def stream_response(self, send):
        # The last piece of the stream (a `Last`) ends the body in the same write; Starlette's
        # version ends it with an empty chunk, one more write and client wake-up per request.
        # The headers go out at once: a queued request's client knows it was accepted.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for piece in self.body_iterator:
            last = isinstance(piece, Last)
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


def finish_reason(ev: Event) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def failed(ev: Event) -> bool:
    return ev.finish_reason in ("error", "cancelled")


def usage_of(finals: list[Event]) -> dict:
    us = [ev.usage or {} for ev in finals]
    prompt = us[0].get("prompt_tokens", 0) if us else 0
    completion = sum(u.get("completion_tokens", 0) for u in us)
    # as the OpenAI API reports them: prompt tokens served from the prefix cache (the choices share
    # one prompt; each was prefilled on its own, so the smallest count is what every one reused)
    cached = min((u.get("cached_tokens", 0) for u in us), default=0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Reply:
    """The response objects of one request with `n` choices: its id, the whole JSON body or
    the stream's chunks (with each choice's index and, for completions, text offsets)."""

    def __init__(self, oid: str, *, chat: bool, model: str, n: int, include_usage: bool, lp_format: LogProbs | None):
        self.oid, self.chat, self.model, self.include_usage, self.lp_format = oid, chat, model, include_usage, lp_format
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        self.offsets = [0] * n  # completions: text offset of each choice's next token

    def whole(self, texts: list[list[str]], lps: list[list[Event]], finals: list[Event]) -> dict:
        """The JSON body of a reply that is not streamed."""
        choices = []
        for i, ev in enumerate(finals):
            body = "".join(texts[i])
            logprobs = self.lp_format.whole(lps[i]) if self.lp_format is not None else None
            choices.append({"index": i, "message": {"role": "assistant", "content": body}, "logprobs": logprobs,
                            "finish_reason": finish_reason(ev)} if self.chat else
                           {"index": i, "text": body, "logprobs": logprobs, "finish_reason": finish_reason(ev)})
        return {"id": self.oid, "object": self.kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_of(finals), "system_fingerprint": None}

    def chunk(self, i: int, delta: str | None, finish: str | None, first: bool = False, ev: Event | None = None) -> str:
        """One server-sent event: choice `i`'s text `delta` (and logprobs) or its finish."""
        logprobs = None
        if self.lp_format is not None and ev is not None and ev.log_probs:
            logprobs, self.offsets[i] = self.lp_format.delta(ev, self.offsets[i])
        if self.chat:
            d: dict = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
        obj = {"id": self.oid, "object": self.chunk_kind, "created": self.created, "model": self.model,
               "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return f"data: {dumps(obj)}\n\n"

    def usage_chunk(self, finals: list[Event]) -> str:
        obj = {"id": self.oid, "object": self.chunk_kind, "created": self.created, "model": self.model,
               "choices": [], "usage": usage_of(finals)}
        return f"data: {dumps(obj)}\n\n"
