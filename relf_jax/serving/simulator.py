"""A discrete-event simulator of a non-preemptive server, driven by measured service times.

Each job carries what was measured when it was run alone: its service time (seconds from
start to last token) and its first-token time (seconds from start to the first committed
block), plus the predictions a policy may rank by. The simulator replays arrivals against a
server of `slots` slots in virtual time and reports per-job start, finish, latency, time to
first token and wait. The queue and policies are `relf_jax.serving.scheduler`'s, the same the
live server uses.

Model of a batched server: B slots, each serving one request at a time at its measured
service time, with no slowdown from sharing the accelerator. That is exact for ``slots=1``
and optimistic for a continuous-batching engine whose per-step time grows with batch size;
it keeps the comparison between policies paired and simple.

Event order at one instant: completions free their slots, then every arrival at that instant
joins the queue, then the policy fills free slots. So a request arriving exactly when a slot
frees competes for it, and simultaneous arrivals at an idle server are ranked, not served
in index order.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Mapping, Sequence

import numpy as np

from relf_jax.serving.scheduler import Policy, Request, RequestQueue


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Per-job outcomes, all float64 [n] in seconds except `slot` (int64 [n])."""

    start: np.ndarray
    finish: np.ndarray
    latency: np.ndarray  # finish - arrival
    ttft: np.ndarray  # start + first_token - arrival
    wait: np.ndarray  # start - arrival
    slot: np.ndarray  # which slot served the job


def _as_times(name: str, x, n: int | None = None) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1 or (n is not None and a.shape[0] != n):
        want = "[n]" if n is None else f"[{n}]"
        raise ValueError(f"{name} must have shape {want}, got {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} must be finite")
    return a


def _check_jobs(service, first_token, predicted, arrival=None):
    service = _as_times("service", service)
    n = service.shape[0]
    if n == 0:
        raise ValueError("need at least one job")
    first_token = _as_times("first_token", first_token, n)
    if np.any(service < 0) or np.any(first_token < 0):
        raise ValueError("service and first_token must be >= 0")
    if np.any(first_token > service):
        raise ValueError("first_token must be <= service (the first block commits within the request)")
    if arrival is not None:
        arrival = _as_times("arrival", arrival, n)
        if np.any(arrival < 0):
            raise ValueError("arrival must be >= 0")
    preds = {}
    for k, v in predicted.items():
        v = np.asarray(v, dtype=np.float64)
        if v.shape != (n,):
            raise ValueError(f"predicted[{k!r}] must have shape [{n}], got {v.shape}")
        preds[k] = v
    return arrival, service, first_token, preds


def simulate(
    arrival,
    service,
    first_token,
    predicted: Mapping[str, np.ndarray],
    policy: Policy,
    slots: int = 1,
) -> SimResult:
    """Replay jobs arriving at `arrival` [n] through a `slots`-slot non-preemptive server.

    `service` [n] and `first_token` [n] are measured seconds (0 <= first_token <= service);
    `predicted` maps names to [n] arrays, handed to the policy as ``Request.predicted``. When
    a slot frees, `policy` picks among the requests queued at that moment (see the module
    docstring for the order of simultaneous events). Job ``j`` is ``Request(id=j)``, so ties in
    score and arrival go to the lower index. Free slots are taken lowest index first.
    """
    if not (isinstance(slots, (int, np.integer)) and slots >= 1):
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    arrival, service, first_token, preds = _check_jobs(service, first_token, predicted, arrival)
    n = service.shape[0]
    order = np.argsort(arrival, kind="stable")
    queue = RequestQueue(policy)
    start = np.empty(n)
    slot_of = np.empty(n, dtype=np.int64)
    free = list(range(int(slots)))  # heap of idle slot ids
    busy: list[tuple[float, int]] = []  # heap of (finish time, slot id)
    keys = list(preds)
    cols = [preds[k].tolist() for k in keys]  # python floats: cheaper per-request dicts
    arr = arrival.tolist()
    nxt = 0  # next index into `order` not yet arrived
    while nxt < n or len(queue):
        # The next event time: the earliest completion or arrival still to come.
        t = math.inf
        if busy:
            t = busy[0][0]
        if nxt < n:
            t = min(t, arr[order[nxt]])
        while busy and busy[0][0] <= t:
            heapq.heappush(free, heapq.heappop(busy)[1])
        while nxt < n and arr[order[nxt]] <= t:
            j = int(order[nxt])
            queue.push(Request(id=j, arrival=arr[j], predicted={k: c[j] for k, c in zip(keys, cols)}))
            nxt += 1
        while free and len(queue):
            j = queue.pop(t).id
            s = heapq.heappop(free)
            start[j] = t
            slot_of[j] = s
            heapq.heappush(busy, (t + service[j], s))
    finish = start + service
    return SimResult(
        start=start,
        finish=finish,
        latency=finish - arrival,
        ttft=start + first_token - arrival,
        wait=start - arrival,
        slot=slot_of,
    )


def poisson_arrivals(rate: float, n: int, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """Arrival times [n] of a Poisson process of `rate` per second from t=0 (first arrival > 0)."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be > 0, got {rate}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(rng)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def summarize(x) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` of a non-empty sample, as python floats."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError("cannot summarize an empty sample")
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def _mean_of(summaries: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([s[k] for s in summaries])) for k in summaries[0]}


def load_sweep(
    service,
    first_token,
    predicted: Mapping[str, np.ndarray],
    policies: Mapping[str, Policy],
    loads: Sequence[float],
    seeds: Sequence[int],
    n_jobs: int,
    slots: int = 1,
) -> dict:
    """Latency and TTFT of each policy at each offered load, averaged over seeds.

    `service`, `first_token` [m] and `predicted` ([m] each) are a measured pool. Per seed,
    `n_jobs` jobs are drawn from the pool with replacement (predictions travel with them) and
    one unit-rate Poisson stream is drawn; at load L its times are divided by the rate
    ``L * slots / mean(pool service)``, so L is the expected fraction of busy slots. Every
    policy and every load of a seed sees the same jobs in the same order (a paired comparison).
    The server starts empty and no warm-up is discarded.

    Returns (JSON-safe; loads keyed by ``str(load)``)::

        {"latency": {policy: {load: {"mean", "p50", "p90", "p99"}}},   # each averaged over seeds
         "ttft": {...same...},
         "per_seed_mean_latency": {policy: {load: [one mean per seed]}},
         "per_seed_mean_ttft": {policy: {load: [...]}},
         "config": {"loads", "seeds", "n_jobs", "slots", "mean_service", "pool_size"}}
    """
    if not (isinstance(slots, (int, np.integer)) and slots >= 1):
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    _, service, first_token, preds = _check_jobs(service, first_token, predicted)
    loads = [float(x) for x in loads]
    seeds = [int(s) for s in seeds]
    if not loads or any(not 0 < x < 1 for x in loads):
        raise ValueError(f"loads must be a non-empty list in (0, 1), got {loads}")
    if not seeds:
        raise ValueError("need at least one seed")
    if n_jobs < 1:
        raise ValueError(f"n_jobs must be >= 1, got {n_jobs}")
    if not policies:
        raise ValueError("need at least one policy")
    mean_service = float(service.mean())
    if mean_service <= 0:
        raise ValueError("the pool's mean service time must be > 0")
    m = service.shape[0]

    lat: dict[str, dict[str, list]] = {p: {str(x): [] for x in loads} for p in policies}
    ttft: dict[str, dict[str, list]] = {p: {str(x): [] for x in loads} for p in policies}
    for seed in seeds:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, m, size=n_jobs)
        unit = poisson_arrivals(1.0, n_jobs, rng)  # rescaled per load: same stream, all loads
        jobs = (service[idx], first_token[idx], {k: v[idx] for k, v in preds.items()})
        for load in loads:
            arrival = unit * mean_service / (load * slots)
            for name, policy in policies.items():
                r = simulate(arrival, *jobs, policy, slots=slots)
                lat[name][str(load)].append(summarize(r.latency))
                ttft[name][str(load)].append(summarize(r.ttft))

    return {
        "latency": {p: {x: _mean_of(v) for x, v in d.items()} for p, d in lat.items()},
        "ttft": {p: {x: _mean_of(v) for x, v in d.items()} for p, d in ttft.items()},
        "per_seed_mean_latency": {p: {x: [s["mean"] for s in v] for x, v in d.items()} for p, d in lat.items()},
        "per_seed_mean_ttft": {p: {x: [s["mean"] for s in v] for x, v in d.items()} for p, d in ttft.items()},
        "config": {
            "loads": loads,
            "seeds": seeds,
            "n_jobs": int(n_jobs),
            "slots": int(slots),
            "mean_service": mean_service,
            "pool_size": int(m),
        },
    }
