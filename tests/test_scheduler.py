"""Queue policies: service order, ties, aging, names, capacity and removal."""

import pytest

from relf_jax.serving.scheduler import (
    FCFS,
    SJF,
    Priority,
    QueueFull,
    Request,
    RequestQueue,
    SchedulerError,
    aging_for,
    make_policy,
)


def _req(i, arrival, cost=1.0, priority=0):
    return Request(id=i, arrival=arrival, predicted={"cost": cost}, priority=priority)


def _drain(q, now):
    out = []
    while len(q):
        out.append(q.pop(now).id)
    return out


def test_fcfs_serves_in_arrival_order():
    q = RequestQueue(FCFS())
    for i, (a, c) in enumerate([(2.0, 1.0), (0.5, 9.0), (1.0, 0.1), (3.0, 5.0)]):
        q.push(_req(i, a, c))
    assert _drain(q, now=10.0) == [1, 2, 0, 3]


def test_sjf_serves_smallest_predicted_first():
    q = RequestQueue(SJF("cost"))
    for i, (a, c) in enumerate([(0.0, 3.0), (1.0, 1.0), (2.0, 2.0), (3.0, 0.5)]):
        q.push(_req(i, a, c))
    assert q.peek(5.0).id == 3 and len(q) == 4  # peek leaves it queued
    assert _drain(q, now=5.0) == [3, 1, 2, 0]


def test_ties_break_by_arrival_then_id():
    q = RequestQueue(SJF("cost"))
    q.push(_req(7, 1.0, 2.0))
    q.push(_req(3, 1.0, 2.0))
    q.push(_req(5, 0.5, 2.0))
    q.push(_req(9, 2.0, 1.0))
    assert _drain(q, now=3.0) == [9, 5, 3, 7]
    q = RequestQueue(FCFS())
    for i in (4, 2, 8):
        q.push(_req(i, 1.0))
    assert _drain(q, now=1.0) == [2, 4, 8]


def test_aging_lets_old_long_request_overtake_new_short_one():
    aging, c_long, c_min = 0.5, 10.0, 1.0
    bound = (c_long - c_min) / aging  # 18 s: the documented wait after which it outranks newcomers
    for now, long_first in [(bound - 0.1, False), (bound + 0.1, True)]:
        q = RequestQueue(SJF("cost", aging=aging))
        q.push(_req("long", 0.0, c_long))
        q.push(_req("short", now, c_min))  # arriving this instant, smallest possible size
        assert (q.pop(now).id == "long") is long_first
    # Plain SJF never lets it through, however long it waited.
    q = RequestQueue(SJF("cost"))
    q.push(_req("long", 0.0, c_long))
    q.push(_req("short", 1e6, c_min))
    assert q.pop(1e6).id == "short"


def test_priority_with_aging():
    q = RequestQueue(Priority())
    q.push(_req(0, 0.0, priority=0))
    q.push(_req(1, 1.0, priority=2))
    q.push(_req(2, 2.0, priority=2))
    q.push(_req(3, 0.5, priority=0))
    assert _drain(q, now=5.0) == [1, 2, 0, 3]
    # Two levels at 1 level/s: the low one overtakes a top-level newcomer after 2 s.
    q = RequestQueue(Priority(aging=1.0))
    q.push(_req("low", 0.0, priority=0))
    q.push(_req("high", 2.5, priority=2))
    assert q.pop(2.5).id == "low"


def test_make_policy_names_and_errors():
    assert make_policy("fcfs") == FCFS()
    assert make_policy("SJF:dws_cost", aging=0.25) == SJF("dws_cost", 0.25)
    assert make_policy("sjf:oracle") == SJF("oracle", 0.0)
    assert make_policy("priority", aging=1.0) == Priority(1.0)
    for bad in ("lifo", "sjf", "sjf:", "fcfs:x", ""):
        with pytest.raises(ValueError, match="valid: fcfs, sjf:<key>, priority"):
            make_policy(bad)
    with pytest.raises(ValueError, match="bad arguments"):
        make_policy("fcfs", aging=1.0)
    with pytest.raises(ValueError, match="aging"):
        make_policy("sjf:length", aging=-1.0)


def test_aging_for_spread_over_horizon():
    sizes = list(range(101))  # p10 = 10, p90 = 90
    assert aging_for(sizes, horizon=8.0) == pytest.approx(10.0)
    assert aging_for([3.0, 3.0, 3.0], horizon=1.0) == 0.0
    assert aging_for([1.0] * 95 + [21.0] * 5, horizon=2.0) == pytest.approx(10.0)  # range fallback
    with pytest.raises(ValueError):
        aging_for(sizes, horizon=0.0)
    with pytest.raises(ValueError):
        aging_for([], horizon=1.0)


def test_queue_full_at_max_size():
    q = RequestQueue(FCFS(), max_size=2)
    q.push(_req(0, 0.0))
    q.push(_req(1, 0.1))
    assert q.full
    with pytest.raises(QueueFull):
        q.push(_req(2, 0.2))
    assert issubclass(QueueFull, SchedulerError)
    assert len(q) == 2
    q.pop(1.0)
    q.push(_req(2, 0.2))  # room again after a pop
    with pytest.raises(ValueError):
        RequestQueue(FCFS(), max_size=0)


def test_remove_and_errors():
    q = RequestQueue(SJF("cost"))
    for i, c in enumerate([3.0, 1.0, 2.0]):
        q.push(_req(i, float(i), c))
    assert 1 in q
    assert q.remove(1).id == 1
    assert 1 not in q and q.remove(1) is None  # already gone: a late disconnect is harmless
    assert _drain(q, now=5.0) == [2, 0]
    with pytest.raises(IndexError):
        q.pop(0.0)
    assert q.peek(0.0) is None
    q.push(_req(0, 0.0))
    with pytest.raises(ValueError, match="already queued"):
        q.push(_req(0, 1.0))
    with pytest.raises(ValueError, match="lacks predicted"):
        q.push(Request(id=5, arrival=0.0, predicted={"length": 3.0}))
    with pytest.raises(TypeError):
        RequestQueue(object())
