"""A request's life in the batcher (`relf_jax.serving.batching`): what a caller submits
(`GenerationRequest`), what its sink receives (`Event`), the batcher's record of it (`Live`),
the running totals behind /metrics (`Stats`), and the text held back while it could still
start a stop string (`holdback`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from relf_jax.serving.engine_api import RequestParams


class ServerClosed(Exception):
    """The batcher is draining or stopped and takes no new requests."""


@dataclasses.dataclass
class GenerationRequest:
    prompt: list[int]  # token ids, BOS first
    params: RequestParams
    stop: tuple[str, ...] = ()  # stop strings: the reply ends before the first one
    priority: int = 0
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)  # for SJF policies
    id: str = ""


@dataclasses.dataclass
class Event:
    """What a sink receives: text deltas, then one final event with ``finish_reason`` set."""

    request_id: str
    text: str = ""  # new text since the previous event
    token_ids: list[int] = dataclasses.field(default_factory=list)  # the tokens behind it
    log_probs: list | None = None  # per token of token_ids: (log-prob, [(id, log-prob), ...]) when asked
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    usage: dict | None = None  # on the final event: prompt/completion tokens, timings
    error: str | None = None


@dataclasses.dataclass
class Live:
    """A request in the batcher: its sink, reply so far and timings."""

    req: GenerationRequest
    sink: Callable[[Event], None]
    arrival: float
    admitted: float = 0.0
    first_token: float = 0.0
    model_s: float = 0.0
    ids: list[int] = dataclasses.field(default_factory=list)  # reply tokens (stop token excluded)
    generated: int = 0  # tokens the engine produced for it (stop token included)
    sent: str = ""  # text already sent
    unsent_ids: list[int] = dataclasses.field(default_factory=list)  # reply tokens whose text is held back
    slot: int = -1
    steps: int = 0
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens the engine's prefix cache held (`Prefix.cached_tokens`)
    finished: bool = False


class Stats:
    """Running totals for /metrics (all updated under the batcher's lock)."""

    def __init__(self):
        self.requests = {"stop": 0, "length": 0, "cancelled": 0, "error": 0}
        self.tokens = 0
        self.model_s = 0.0
        self.steps = 0
        self.slot_steps = 0  # occupied slots summed over steps
        self.accepted = 0  # speculative: accepted draft tokens
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.ttft_buckets = {b: 0 for b in (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))}
        self.e2e_sum = 0.0
        self.e2e_count = 0
        self.rejected = 0  # 429s
        self.overlapped = 0  # steps dispatched before the previous step's host work (see `Batcher`)
        self.ready_early = 0  # of those, steps that had finished before they were collected
        self.started = time.monotonic()

    def observe_ttft(self, s: float) -> None:
        self.ttft_sum += s
        self.ttft_count += 1
        for b in self.ttft_buckets:
            if s <= b:
                self.ttft_buckets[b] += 1


def holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` to hold back: a possible stop-string start or a partial character."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                n = max(n, k)
                break
    if text.endswith("\ufffd"):
        n = max(n, len(text) - len(text.rstrip("\ufffd")))
    return n
