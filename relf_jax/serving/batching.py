"""Continuous batching: one engine, a bounded queue under a pluggable policy, slots that
requests join and leave between engine steps.

`Batcher` runs the loop in a background thread:

1. drop cancelled requests (queued ones leave the queue; running ones free their slot at once);
2. admit: while a slot is free and the queue is not empty, pop the request the policy ranks
   first (`relf_jax.serving.scheduler`), `prefill` it and `insert` it into the slot;
3. one `generate` step for every occupied slot; each slot's new tokens are turned into text
   (held back while they could still be the start of a stop string or an unfinished UTF-8
   character) and sent to the request's sink, with their log-probabilities when the request
   asked for them; a request ends at a stop token (the engine's or one of its own
   ``stop_token_ids``), a stop string, its `max_tokens`, or the end of the context, and its slot
   is freed before the next step.

Overlap (``overlap=True``; the default is the engine's `Engine.overlap_default`: on for the
AR and speculative engines, whose steps are dispatched asynchronously by `Engine.dispatch` /
`collect`): when a step's output ends no request for certain (no slot the engine stopped, none
at its `max_tokens`) and nobody waits for a free slot, the next step is dispatched *before*
that output's text, sinks and bookkeeping are done, so the host work runs while the model
computes.

A request that a stop string (or a cancel) ends during that host work has one more step
computed for it; its tokens are dropped (a step's outputs go to the requests that held its
slots when it was dispatched) and its slot is freed after that step, as after any step.
Requests are only admitted while no step is in flight, so a prefill is never timed behind a
step. Each request's tokens are the same with and without overlap (tested).

Callers `submit` a `GenerationRequest` with a *sink*, a function called (from the batcher's
thread) with each `Event`; the server bridges it into asyncio, `ChatModel` into a queue.
`submit` raises `QueueFull` when the queue is at its bound (the server answers 429). `stop`
drains: it refuses new requests, lets queued and running ones finish, then ends the thread.

Timing: every request records its arrival, admission, first token and end (monotonic
seconds) and the engine seconds spent on it (its prefill plus every step while it held a
slot), so the overhead of everything that is not a model step can be measured.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from relf_jax.serving.engine_api import Engine
from relf_jax.serving.request_types import Event, GenerationRequest, Live, ServerClosed, Stats, holdback
from relf_jax.serving.scheduler import FCFS, Policy, QueueFull, Request, RequestQueue

__all__ = ["Batcher", "Event", "GenerationRequest", "QueueFull", "ServerClosed"]


class Batcher:
    """Continuous batching over `engine` (see the module docstring).

    policy: a `relf_jax.serving.scheduler` policy (default FCFS); max_queue: the queue bound
    (None: unbounded); cost_fn: ``prompt ids -> dict`` of predictions a policy ranks by (e.g.
    ``{"dws_cost": seconds}``), called at submit for requests that carry none; overlap: dispatch
    the next step before the host work on the last one when that is safe (module docstring;
    None: ``engine.overlap_default``).
    """

    def __init__(self, engine: Engine, policy: Policy | None = None, *, max_queue: int | None = 256,
                 cost_fn: Callable[[Sequence[int]], dict[str, float]] | None = None, idle_wait_s: float = 0.05,
                 overlap: bool | None = None):
        self.engine = engine
        self.overlap = engine.overlap_default if overlap is None else bool(overlap)
        self.queue = RequestQueue(policy or FCFS(), max_size=max_queue)
        self.cost_fn = cost_fn
        self.idle_wait_s = idle_wait_s
        self.stats = Stats()
        self._lock = threading.Condition()
        self._live: dict[str, Live] = {}
        self._slots: list[str | None] = [None] * engine.num_slots
        self._cancel: set[str] = set()
        self._ids = itertools.count()
        self._state: Any = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stopped = False
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> Batcher:
        if self._thread is None:
            self._state = self.engine.init_state()
            self._thread = threading.Thread(target=self._run, name=f"batcher-{self.engine.name}", daemon=True)
            self._thread.start()
        return self

    def submit(self, req: GenerationRequest, sink: Callable[[Event], None]) -> str:
        """Queue `req`; `sink` gets its events. Raises QueueFull, ServerClosed or UserError."""
        self.engine.check_request(len(req.prompt), req.params.max_tokens)
        self.engine.check_params(req.params)
        if not req.predicted and self.cost_fn is not None:
            req.predicted = dict(self.cost_fn(req.prompt))
        with self._lock:
            if self._closing:
                raise ServerClosed("the server is shutting down")
            if not req.id:
                req.id = f"req-{next(self._ids)}"
            now = time.monotonic()
            try:
                self.queue.push(Request(id=req.id, arrival=now, predicted=req.predicted, priority=req.priority,
                                        payload=req.id))
            except QueueFull:
                self.stats.rejected += 1
                raise
            self._live[req.id] = Live(req=req, sink=sink, arrival=now)
            self._lock.notify_all()
        return req.id

    def cancel(self, request_id: str) -> None:
        """Drop a request (its client went away): a queued one leaves the queue at once (its
        place is free for the next submit); a running one frees its slot before the next step."""
        with self._lock:
            live = self._live.get(request_id)
            if live is None:
                return
            if self.queue.remove(request_id) is not None:
                self._finish(live, "cancelled")
            else:
                self._cancel.add(request_id)
                self._lock.notify_all()

    def queue_length(self) -> int:
        with self._lock:
            return len(self.queue)

    def active(self) -> int:
        with self._lock:
            return sum(s is not None for s in self._slots)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._live)

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new requests; with `drain`, finish the queued and running ones first; end the thread."""
        with self._lock:
            self._closing = True
            if not drain:
                self._cancel.update(self._live)
            self._lock.notify_all()
        if self._thread is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._lock:
                while self._live and self._thread.is_alive():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._lock.wait(timeout=0.05 if left is None else min(left, 0.05))
            with self._lock:
                self._stopped = True
                self._lock.notify_all()
            self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        pending = None  # the step in flight: (engine handle, slot -> request id at dispatch, overlapped)
        try:
            while True:
                with self._lock:
                    self._drop_cancelled()
                    if self._stopped:
                        return
                    if not self._live and pending is None:
                        self._lock.wait(timeout=self.idle_wait_s)
                        continue
                if pending is not None:
                    handle, owners, overlapped = pending
                    out = self.engine.collect(handle)
                    if overlapped:
                        with self._lock:
                            self.stats.overlapped += 1
                            self.stats.ready_early += bool(out.ready_early)
                    pending = self._dispatch(True) if self.overlap and self._can_overlap(out, owners) else None
                    self._take_step(out, owners)
                    if pending is not None:
                        continue
                self._admit()
                if any(s is not None for s in self._slots):
                    pending = self._dispatch(False)
                else:
                    with self._lock:
                        if not len(self.queue):
                            self._lock.wait(timeout=self.idle_wait_s)
        except BaseException as e:  # noqa: BLE001 - report to every waiting request, then stop
            self.error = e
            with self._lock:
                for live in list(self._live.values()):
                    live.slot = -1  # the engine state is not trusted any more: free nothing
                    self._finish(live, "error", error=f"engine failure: {type(e).__name__}: {e}")
                self._closing = self._stopped = True
                self._lock.notify_all()

    def _drop_cancelled(self) -> None:  # under the lock
        for rid in list(self._cancel):
            live = self._live.get(rid)
            self._cancel.discard(rid)
            if live is None:
                continue
            self.queue.remove(rid)
            self._finish(live, "cancelled")

    def _admit(self) -> None:
        while True:
            with self._lock:
                self._drop_cancelled()
                free = [i for i, s in enumerate(self._slots) if s is None]
                if not free or not len(self.queue):
                    return
                rid = self.queue.pop(time.monotonic()).payload
                live = self._live[rid]
                live.admitted = time.monotonic()
                slot = free[0]
                self._slots[slot] = rid
                live.slot = slot
            self._state, prefix = self.engine.prefill_insert(live.req.prompt, live.req.params, self._state, slot)
            with self._lock:
                live.cached_tokens = prefix.cached_tokens
                live.model_s += prefix.model_s
                self.stats.model_s += prefix.model_s
                if self._take(live, prefix.tokens, prefix.done, from_step=False, log_probs=prefix.log_probs):
                    self._release(live)

    def _dispatch(self, overlapped: bool) -> tuple[Any, list[str | None], bool] | None:
        """Start a step over the occupied slots; None when none is occupied."""
        with self._lock:
            owners = list(self._slots)
        if all(r is None for r in owners):
            return None
        self._state, handle = self.engine.dispatch(self._state)
        return handle, owners, overlapped

    def _can_overlap(self, out, owners: list[str | None]) -> bool:
        """The next step may start before `out`'s host work: no request ends for certain in
        `out` (the engine stopped none, none reaches its max_tokens; a stop string may still end
        one) and no queued request waits for a slot."""
        with self._lock:
            if len(self.queue) and any(s is None for s in self._slots):
                return False
            for slot, rid in enumerate(owners):
                live = self._live.get(rid) if rid is not None else None
                if live is None or live.finished:
                    continue
                if out.done[slot] or len(live.ids) + len(out.tokens[slot]) >= live.req.params.max_tokens:
                    return False
        return True

    def _take_step(self, out, owners: list[str | None]) -> None:
        """Send a collected step's tokens to the requests that held its slots at dispatch."""
        with self._lock:
            self.stats.steps += 1
            self.stats.model_s += out.model_s
            for slot, rid in enumerate(owners):
                if rid is None:
                    continue
                live = self._live.get(rid)
                if live is None:
                    continue
                steps = 1 if out.steps is None else out.steps[slot]  # sampler steps (several per call)
                self.stats.slot_steps += steps
                live.steps += steps
                live.model_s += out.model_s
                if out.accepted is not None:
                    live.accepted += out.accepted[slot]
                    self.stats.accepted += out.accepted[slot]
                lps = out.log_probs[slot] if out.log_probs is not None else None
                if self._take(live, out.tokens[slot], out.done[slot], log_probs=lps):
                    self._release(live)

    def _release(self, live: Live, stopped: bool = False) -> None:  # under the lock
        """Free the request's slot; `stopped`: the engine reported the slot done (see `Engine.free`)."""
        if live.slot >= 0 and self._slots[live.slot] == live.req.id:
            self._state = self.engine.free(self._state, live.slot, stopped=stopped)
            self._slots[live.slot] = None
        live.slot = -1

    def _take(self, live: Live, tokens: Sequence[int], engine_done: bool,
              from_step: bool = True, log_probs: Sequence | None = None) -> bool:  # under the lock
        """Add new tokens to a request; send text; True when the request is finished.

        engine_done: the engine says the slot stopped; from_step: the tokens come from `generate`
        (whose done flag is the device slot's own; a prefill's is not, see `Engine.free`);
        log_probs: the engine's entries per token (sent on when the request asked)."""
        if live.finished:
            return True
        if tokens and not live.first_token:
            live.first_token = time.monotonic()
            self.stats.observe_ttft(live.first_token - live.arrival)
        tok = self.engine.tokenizer
        finish = None
        new_ids = []
        want_lp = live.req.params.logprobs is not None and log_probs is not None
        new_lps = [] if want_lp else None
        own_stops = live.req.params.stop_token_ids
        for i, t in enumerate(tokens):
            live.generated += 1
            self.stats.tokens += 1
            if t in self.engine.stop_ids or t in own_stops:
                finish = "stop"
                break
            live.ids.append(int(t))
            new_ids.append(int(t))
            if want_lp:
                new_lps.append(log_probs[i])
            if len(live.ids) >= live.req.params.max_tokens:
                finish = "length"
                break
        if finish is None and engine_done:
            finish = "length"  # the engine ran out of context without a stop token
        text = tok.decode(live.ids)
        stop_at = -1
        for s in live.req.stop:
            i = text.find(s, max(0, len(live.sent) - len(s)))
            if i >= 0 and (stop_at < 0 or i < stop_at):
                stop_at = i
        if stop_at >= 0:
            text, finish = text[:stop_at], "stop"
        elif finish is None:
            text = text[:len(text) - holdback(text, live.req.stop)]
        delta = text[len(live.sent):] if text.startswith(live.sent) else ""
        live.unsent_ids += new_ids  # tokens whose text is held back go with the next event
        if delta or new_lps:
            live.sent += delta
            live.sink(Event(request_id=live.req.id, text=delta, token_ids=live.unsent_ids, log_probs=new_lps))
            live.unsent_ids = []
        if finish is not None:
            self._finish(live, finish, stopped=engine_done and from_step)
            return True
        return False

    def _finish(self, live: Live, reason: str, error: str | None = None,
                stopped: bool = False) -> None:  # under the lock
        if live.finished:
            return
        live.finished = True
        if live.slot >= 0 and self._slots[live.slot] == live.req.id:
            try:  # before the slot is freed: the engine may keep the request's keys/values (`Engine.keep_prefix`)
                self.engine.keep_prefix(self._state, live.slot, [*live.req.prompt, *live.ids],
                                        len(live.req.prompt) + live.generated)
            except Exception as e:  # never fails the request; said on stderr
                print(f"[batcher] {self.engine.name}: keep_prefix failed: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
        self._release(live, stopped)
        self._live.pop(live.req.id, None)
        self.stats.requests[reason] = self.stats.requests.get(reason, 0) + 1
        end = time.monotonic()
        if reason in ("stop", "length"):
            self.stats.e2e_sum += end - live.arrival
            self.stats.e2e_count += 1
            try:  # the engine may learn from what it answered (`Engine.request_finished`)
                self.engine.request_finished(live.req.prompt, live.ids)
            except Exception as e:  # never fails the request; said on stderr
                print(f"[batcher] {self.engine.name}: request_finished failed: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
        usage = {"prompt_tokens": len(live.req.prompt), "cached_tokens": live.cached_tokens,
                 "completion_tokens": live.generated,
                 "total_tokens": len(live.req.prompt) + live.generated,
                 "queue_s": (live.admitted or end) - live.arrival,
                 "ttft_s": (live.first_token - live.arrival) if live.first_token else None,
                 "e2e_s": end - live.arrival, "model_s": live.model_s, "steps": live.steps,
                 "accepted": live.accepted}
        try:
            live.sink(Event(request_id=live.req.id, finish_reason=reason, usage=usage, error=error,
                            token_ids=live.unsent_ids))
        finally:
            self._lock.notify_all()
