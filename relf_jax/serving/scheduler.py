"""Queue policies for a non-preemptive server: FCFS, shortest-job-first with aging, priority.

One module serves two clocks. The discrete-event simulator calls it in virtual time; the live
server calls it in wall-clock time (``time.monotonic()``). Nothing here sleeps, awaits or
locks: the methods are plain and synchronous, and a caller that shares a queue between tasks
or threads holds its own lock around them.

A policy maps a queued `Request` and the current time to a score; the queue serves the lowest
score, ties broken by arrival time and then by id. Sizes, aging rates and times must share
units: with ``SJF(key="dws_cost", aging=a)`` a request gains ``a`` units of predicted cost per
second it waits.

Starvation bound of `SJF` (and `Priority`, with priority levels for sizes). A request of
predicted size ``c`` that arrived at ``t0`` has score ``c - aging * (now - t0)``; one that
arrives at ``t1`` has score at least ``c_min - aging * (now - t1)``, with ``c_min >= 0`` the
smallest size that can arrive. The difference of the two scores does not depend on ``now``, so
the older request outranks every request arriving after ``t0 + W``, ``W = (c - c_min) / aging``,
at every later moment. Past that point it waits only for the one in service (per slot) and
for the finitely many requests that arrived before ``t0 + W`` and outrank it, so its wait is
bounded. ``aging = 0`` is plain SJF, which can starve a long request under a steady stream of
short ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np


class SchedulerError(Exception):
    """Base of the errors the scheduler raises for a request it cannot take."""


class QueueFull(SchedulerError):
    """The queue is at ``max_size``; the live server answers HTTP 429 (retry later)."""


@dataclasses.dataclass
class Request:
    """One queued request.

    `id` is unique within a queue, and the ids of one queue are mutually orderable (all ints
    or all strs), since they break ties. `arrival` is in seconds on the caller's clock.
    `predicted` holds the predictor outputs a policy may rank by, e.g. ``{"dws_cost": ..,
    "length": .., "steps": .., "prompt_len": .., "oracle": ..}``. `payload` is whatever the
    caller needs back when the request is popped (a prompt, a future, a job index).
    """

    id: Hashable
    arrival: float
    predicted: dict[str, float] = dataclasses.field(default_factory=dict)
    priority: int = 0
    payload: Any = None


@runtime_checkable
class Policy(Protocol):
    """Anything with ``score(request, now) -> float``; lower is served first."""

    def score(self, request: Request, now: float) -> float: ...


def _check_aging(aging: float) -> None:
    if not (math.isfinite(aging) and aging >= 0):
        raise ValueError(f"aging must be finite and >= 0, got {aging}")


@dataclasses.dataclass(frozen=True)
class FCFS:
    """First come, first served: score = arrival."""

    def score(self, request: Request, now: float) -> float:
        return float(request.arrival)


@dataclasses.dataclass(frozen=True)
class SJF:
    """Shortest (predicted) job first with linear aging.

    score = ``predicted[key] - aging * (now - arrival)``. `aging` is in size units per second;
    a request that has waited longer than ``(c - c_min) / aging`` seconds outranks every newly
    arriving request (see the module docstring), so nothing starves. ``aging=0`` is plain SJF.
    """

    key: str
    aging: float = 0.0

    def __post_init__(self):
        _check_aging(self.aging)

    def score(self, request: Request, now: float) -> float:
        return float(request.predicted[self.key]) - self.aging * (now - request.arrival)


@dataclasses.dataclass(frozen=True)
class Priority:
    """Higher ``request.priority`` first, FCFS within a level, with aging.

    score = ``-priority - aging * (now - arrival)``; `aging` is in priority levels per second,
    so a request `k` levels below the top outranks every newcomer after waiting ``k / aging``.
    Within a level the scores differ by ``aging * (arrival difference)``, which is FCFS.
    """

    aging: float = 0.0

    def __post_init__(self):
        _check_aging(self.aging)

    def score(self, request: Request, now: float) -> float:
        return -float(request.priority) - self.aging * (now - request.arrival)


def aging_for(sizes: Sequence[float] | np.ndarray, horizon: float, lo: float = 10.0, hi: float = 90.0) -> float:
    """An SJF aging rate: one typical size spread (the `hi` - `lo` percentile gap) per `horizon` s.

    So a request that has waited `horizon` seconds outranks a newcomer up to one spread smaller.
    Falls back to the full range when the percentile gap is zero; 0.0 if all sizes are equal
    (then aging does not matter between them).
    """
    x = np.asarray(sizes, dtype=np.float64).ravel()
    if x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError("sizes must be a non-empty array of finite numbers")
    if not (math.isfinite(horizon) and horizon > 0):
        raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
    if not 0 <= lo < hi <= 100:
        raise ValueError(f"need 0 <= lo < hi <= 100, got lo={lo}, hi={hi}")
    spread = float(np.percentile(x, hi) - np.percentile(x, lo))
    if spread <= 0:
        spread = float(x.max() - x.min())
    return spread / horizon


POLICY_NAMES = ("fcfs", "sjf:<key>", "priority")


def make_policy(name: str, **kw) -> Policy:
    """A policy from a name: ``"fcfs"``, ``"sjf:<key>"`` (e.g. ``"sjf:dws_cost"``), ``"priority"``.

    Keyword arguments go to the policy (``aging=`` for SJF and priority); an unknown name or
    argument raises ValueError naming the valid ones.
    """
    head, sep, key = name.strip().partition(":")
    head = head.lower()
    try:
        if head == "fcfs" and not sep:
            return FCFS(**kw)
        if head == "sjf" and sep and key:
            return SJF(key=key, **kw)
        if head == "priority" and not sep:
            return Priority(**kw)
    except TypeError as e:  # an argument the policy does not take
        raise ValueError(f"bad arguments {sorted(kw)} for policy {name!r}: {e}") from e
    raise ValueError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}")


class RequestQueue:
    """Requests waiting for a slot, served lowest score first under `policy`.

    `pop` and `peek` scan all queued requests: a policy's scores may move with time, so a heap
    keyed at push time could go stale. (For the linear aging above the order between two
    requests happens not to change with time, but the interface allows any policy.) Queues in
    a chatbot server hold tens to hundreds of requests, where O(n) per pop is cheap.
    """

    def __init__(self, policy: Policy, max_size: int | None = None):
        if not isinstance(policy, Policy):
            raise TypeError(f"policy needs a score(request, now) method, got {type(policy).__name__}")
        if max_size is not None and max_size < 1:
            raise ValueError(f"max_size must be >= 1 or None, got {max_size}")
        self.policy = policy
        self.max_size = max_size
        self._items: dict[Hashable, Request] = {}  # insertion-ordered; O(1) remove by id

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._items

    def __iter__(self) -> Iterator[Request]:
        """The queued requests in push order (not service order)."""
        return iter(list(self._items.values()))

    @property
    def full(self) -> bool:
        return self.max_size is not None and len(self._items) >= self.max_size

    def push(self, request: Request) -> None:
        """Queue `request`; QueueFull at `max_size`, ValueError for a duplicate id or unscorable request."""
        if request.id in self._items:
            raise ValueError(f"request id {request.id!r} is already queued")
        if self.full:
            raise QueueFull(f"queue is full ({self.max_size} requests)")
        # Score once now so a request the policy cannot rank fails here, not later inside pop.
        try:
            s = self.policy.score(request, request.arrival)
        except KeyError as e:
            raise ValueError(f"request {request.id!r} lacks predicted[{e.args[0]!r}] needed by {self.policy}") from e
        if not math.isfinite(s):
            raise ValueError(f"request {request.id!r} scores {s} under {self.policy}; need a finite score")
        self._items[request.id] = request

    def _best(self, now: float) -> Request | None:
        if not self._items:
            return None
        score = self.policy.score
        return min(self._items.values(), key=lambda r: (score(r, now), r.arrival, r.id))

    def peek(self, now: float) -> Request | None:
        """The request `pop(now)` would return, left queued; None when empty."""
        return self._best(now)

    def pop(self, now: float) -> Request:
        """Remove and return the lowest-score request at time `now`; IndexError when empty."""
        best = self._best(now)
        if best is None:
            raise IndexError("pop from an empty RequestQueue")
        del self._items[best.id]
        return best

    def remove(self, request_id: Hashable) -> Request | None:
        """Drop a queued request (its client disconnected); returns it, or None if not queued."""
        return self._items.pop(request_id, None)
