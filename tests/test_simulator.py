"""Discrete-event simulator: hand examples, SJF vs FCFS, aging under an adversarial stream, sweeps."""

import json

import numpy as np
import pytest

from relf_jax.serving.scheduler import FCFS, SJF
from relf_jax.serving.simulator import load_sweep, poisson_arrivals, simulate, summarize


def _sim(arrival, service, policy, first_token=None, slots=1):
    service = np.asarray(service, dtype=np.float64)
    ft = np.zeros_like(service) if first_token is None else first_token
    return simulate(arrival, service, ft, {"oracle": service}, policy, slots=slots)


def test_single_server_hand_example():
    arrival = [0.0, 1.0, 2.0, 2.5]
    service = [3.0, 2.0, 1.0, 0.5]
    first_token = np.array([1.0, 0.5, 0.5, 0.25])
    r = _sim(arrival, service, FCFS(), first_token)
    np.testing.assert_array_equal(r.start, [0.0, 3.0, 5.0, 6.0])
    np.testing.assert_array_equal(r.finish, [3.0, 5.0, 6.0, 6.5])
    np.testing.assert_array_equal(r.latency, [3.0, 4.0, 4.0, 4.0])
    np.testing.assert_array_equal(r.ttft, [1.0, 2.5, 3.5, 3.75])
    np.testing.assert_array_equal(r.wait, [0.0, 2.0, 3.0, 3.5])
    # SJF: at t=3 all three wait; shortest first, non-preemptive (job 0 is not interrupted).
    r = _sim(arrival, service, SJF("oracle"), first_token)
    np.testing.assert_array_equal(r.start, [0.0, 4.5, 3.5, 3.0])
    np.testing.assert_array_equal(r.finish, [3.0, 6.5, 4.5, 3.5])
    np.testing.assert_array_equal(r.ttft, [1.0, 4.0, 2.0, 0.75])


def test_arrival_at_completion_instant_joins_before_the_pick():
    # Job 2 arrives exactly when job 0 finishes; it is queued before the pick, so SJF takes it.
    r = _sim([0.0, 0.5, 2.0], [2.0, 5.0, 1.0], SJF("oracle"))
    np.testing.assert_array_equal(r.start, [0.0, 3.0, 2.0])
    # Simultaneous arrivals at an idle server are ranked too.
    r = _sim([1.0, 1.0, 1.0], [3.0, 1.0, 2.0], SJF("oracle"))
    np.testing.assert_array_equal(r.start, [4.0, 1.0, 2.0])


def test_two_slots_hand_example():
    arrival = [0.0, 0.0, 1.0, 1.5]
    service = [4.0, 2.0, 1.0, 0.5]
    r = _sim(arrival, service, FCFS(), slots=2)
    np.testing.assert_array_equal(r.start, [0.0, 0.0, 2.0, 3.0])
    np.testing.assert_array_equal(r.finish, [4.0, 2.0, 3.0, 3.5])
    np.testing.assert_array_equal(r.slot, [0, 1, 1, 1])
    r = _sim(arrival, service, SJF("oracle"), slots=2)
    np.testing.assert_array_equal(r.start, [0.0, 0.0, 2.5, 2.0])
    np.testing.assert_array_equal(r.finish, [4.0, 2.0, 3.5, 2.5])
    # Enough slots: nobody waits.
    r = _sim(arrival, service, FCFS(), slots=4)
    np.testing.assert_array_equal(r.start, arrival)


def test_sjf_with_true_sizes_never_worse_than_fcfs_single_server():
    for seed in range(50):
        rng = np.random.default_rng(seed)
        n = 200
        service = rng.lognormal(0.0, 1.2, n)
        arrival = poisson_arrivals(rng.uniform(0.5, 1.1) / service.mean(), n, rng)
        fcfs = _sim(arrival, service, FCFS()).latency.mean()
        sjf = _sim(arrival, service, SJF("oracle")).latency.mean()
        assert sjf <= fcfs + 1e-9, seed


def test_aging_bounds_the_wait_of_a_long_job_under_a_stream_of_short_ones():
    s, c_long, n_short = 1.0, 10.0, 50
    # A short job starts at t=0; the long one arrives just after; then one short job per
    # second keeps the server busy until t = 1 + n_short (the end of the stream).
    arrival = np.concatenate([[0.0, 0.01], np.arange(n_short) + 0.5])
    service = np.concatenate([[s, c_long], np.full(n_short, s)])
    stream_end = 1.0 + n_short * s
    plain = _sim(arrival, service, SJF("oracle"))
    assert plain.start[1] == stream_end  # starved until the stream ends
    aging = 1.0
    bound = (c_long - s) / aging  # c_min = s: after this wait no newcomer outranks it
    aged = _sim(arrival, service, SJF("oracle", aging=aging))
    # Past the bound it waits at most for the short in service and the one queued before it.
    assert bound < aged.wait[1] <= bound + 2 * s
    assert aged.wait[1] < plain.wait[1] / 4


def test_validation():
    ok = {"arrival": [0.0, 1.0], "service": [1.0, 2.0], "first_token": [0.5, 1.0], "predicted": {"oracle": [1.0, 2.0]}}
    simulate(**ok, policy=FCFS())
    bad = [
        dict(ok, arrival=[0.0, 1.0, 2.0]),
        dict(ok, service=[[1.0, 2.0]]),
        dict(ok, arrival=[-1.0, 1.0]),
        dict(ok, service=[-1.0, 2.0], first_token=[-1.0, 1.0]),
        dict(ok, first_token=[0.5, 3.0]),
        dict(ok, predicted={"oracle": [1.0]}),
        dict(ok, service=[1.0, np.nan]),
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            simulate(**kw, policy=FCFS())
    with pytest.raises(ValueError):
        simulate(**ok, policy=FCFS(), slots=0)
    with pytest.raises(ValueError):
        simulate(**ok, policy=SJF("length"))  # the policy's key is not among the predictions
    pool = {"service": ok["service"], "first_token": ok["first_token"], "predicted": ok["predicted"]}
    for loads in ([0.0], [1.0], [0.5, 1.2], []):
        with pytest.raises(ValueError):
            load_sweep(**pool, policies={"fcfs": FCFS()}, loads=loads, seeds=[0], n_jobs=5)
    with pytest.raises(ValueError):
        load_sweep(**pool, policies={"fcfs": FCFS()}, loads=[0.5], seeds=[0], n_jobs=5, slots=0)


def test_poisson_arrivals_and_summarize():
    a = poisson_arrivals(4.0, 20000, np.random.default_rng(0))
    assert a.shape == (20000,) and np.all(np.diff(a) >= 0) and a[0] > 0
    assert np.mean(np.diff(a)) == pytest.approx(0.25, rel=0.05)
    s = summarize(np.arange(101.0))
    assert s == {"mean": 50.0, "p50": 50.0, "p90": 90.0, "p99": 99.0}
    with pytest.raises(ValueError):
        summarize([])


def _heavy_pool(m=400, seed=123):
    rng = np.random.default_rng(seed)
    service = rng.lognormal(-1.0, 1.5, m)  # heavy right tail: a few very long requests
    first_token = 0.1 * service
    predicted = {"oracle": service, "length": service * rng.lognormal(0.0, 0.5, m)}
    return service, first_token, predicted


def test_load_sweep_keys_determinism_and_sjf_gain():
    service, first_token, predicted = _heavy_pool()
    policies = {"fcfs": FCFS(), "sjf_oracle": SJF("oracle"), "sjf_length": SJF("length", aging=0.01)}
    kw = {"policies": policies, "loads": [0.5, 0.9], "seeds": [0, 1], "n_jobs": 1500}
    out = load_sweep(service, first_token, predicted, **kw)
    assert set(out) >= {"latency", "ttft", "per_seed_mean_latency"}
    for metric in ("latency", "ttft"):
        assert set(out[metric]) == set(policies)
        for p in policies:
            assert set(out[metric][p]) == {"0.5", "0.9"}
            assert set(out[metric][p]["0.9"]) == {"mean", "p50", "p90", "p99"}
    assert len(out["per_seed_mean_latency"]["fcfs"]["0.9"]) == 2
    assert json.loads(json.dumps(out)) == out  # JSON-safe
    assert load_sweep(service, first_token, predicted, **kw) == out  # deterministic given seeds
    lat = out["latency"]
    assert lat["sjf_oracle"]["0.9"]["mean"] < lat["fcfs"]["0.9"]["mean"]
    per_seed = out["per_seed_mean_latency"]
    assert all(s < f for s, f in zip(per_seed["sjf_oracle"]["0.9"], per_seed["fcfs"]["0.9"]))
    assert lat["fcfs"]["0.9"]["mean"] > lat["fcfs"]["0.5"]["mean"]  # more load, more queueing
    # Two slots at the same per-slot load run too.
    out2 = load_sweep(service, first_token, predicted, policies={"fcfs": FCFS()}, loads=[0.9], seeds=[0], n_jobs=300,
                      slots=2)
    assert out2["config"]["slots"] == 2
