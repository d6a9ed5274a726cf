"""Continuous batching over the mock engine: slots, policies, bounds, cancellation, stop strings."""

import queue
import threading
import time

import pytest

from relf_jax.serving.batching import Batcher, GenerationRequest, ServerClosed
from relf_jax.serving.engine_api import RequestParams
from relf_jax.serving.engines import ByteTokenizer, MockEngine
from relf_jax.serving.scheduler import SJF, QueueFull

TOK = ByteTokenizer()


def _req(text, max_tokens=200, **kw):
    return GenerationRequest(prompt=[TOK.bos_id] + TOK.encode(f"<user> {text} <assistant>"),
                             params=RequestParams(max_tokens=max_tokens, temperature=0.0), **kw)


class Collect:
    def __init__(self):
        self.events = queue.SimpleQueue()

    def __call__(self, ev):
        self.events.put(ev)

    def result(self, timeout=10.0):
        text = []
        while True:
            ev = self.events.get(timeout=timeout)
            text.append(ev.text)
            if ev.finish_reason is not None:
                return "".join(text), ev


def test_requests_join_and_leave_slots():
    eng = MockEngine(2, step_s=0.002)
    seen = []
    gen = eng.generate

    def spy(state):  # occupied slots per step never exceed the engine's
        seen.append(sum(s is not None for s in state))
        return gen(state)

    eng.generate = spy
    b = Batcher(eng).start()
    texts = [f"message number {i}" + "!" * i for i in range(6)]
    sinks = [Collect() for _ in texts]
    for t, s in zip(texts, sinks):
        b.submit(_req(t), s)
    for t, s in zip(texts, sinks):
        text, ev = s.result()
        assert text == t and ev.finish_reason == "stop"
        assert ev.usage["completion_tokens"] == len(t) + 1  # + EOS
        assert ev.usage["model_s"] > 0
    assert max(seen) == 2 and 1 in seen  # shorter replies left while longer ones ran
    b.stop()


def test_max_tokens_and_stop_strings():
    b = Batcher(MockEngine(2)).start()
    s = Collect()
    b.submit(_req("abcdefgh", max_tokens=3), s)
    assert s.result()[0] == "abc"
    s2 = Collect()
    b.submit(_req("hello world", stop=("o w", "zz")), s2)
    text, ev = s2.result()
    assert text == "hell" and ev.finish_reason == "stop"
    s3 = Collect()
    b.submit(_req("abc", max_tokens=2), s3)
    text, ev = s3.result()
    assert text == "ab" and ev.finish_reason == "length"
    b.stop()


def test_free_skips_the_device_update_only_for_slots_the_engine_stopped():
    """`Engine.free(stopped=True)` only when the last step reported the slot done; a request that
    the server ends (max_tokens, a stop string, a cancel) or that its prefill ended frees fully."""
    eng = MockEngine(1)
    calls = []
    free = eng.free

    def spy(state, slot, stopped=False):
        calls.append(stopped)
        return free(state, slot, stopped=stopped)

    eng.free = spy
    b = Batcher(eng).start()
    for req, want in ((_req("abc"), True), (_req("abcdef", max_tokens=2), False),
                      (_req("hello world", stop=("lo",)), False), (_req(""), False)):
        s = Collect()
        b.submit(req, s)
        s.result()
        assert calls[-1] is want, (req, calls)
    b.stop()
    assert len(calls) == 4


def test_sjf_admits_the_cheapest_first_and_the_queue_is_bounded():
    eng = MockEngine(1, step_s=0.01)
    b = Batcher(eng, SJF(key="cost"), max_queue=3).start()
    order = []
    lock = threading.Lock()
    all_done = threading.Event()

    def sink_for(name):
        def sink(ev):
            if ev.finish_reason is not None:
                with lock:
                    order.append(name)
                    if len(order) == 4:
                        all_done.set()
        return sink

    started, running = threading.Event(), sink_for("running")

    def first(ev):
        started.set()
        running(ev)

    b.submit(_req("x" * 20, predicted={"cost": 0.0}), first)
    assert started.wait(timeout=10)  # its first token: it holds the only slot
    for name, cost in (("big", 9.0), ("small", 1.0), ("mid", 5.0)):
        b.submit(_req(name, predicted={"cost": cost}), sink_for(name))
    with pytest.raises(QueueFull):
        b.submit(_req("one too many", predicted={"cost": 0.0}), sink_for("x"))
    assert all_done.wait(timeout=30), order
    assert order == ["running", "small", "mid", "big"]
    b.stop()


class CountingMock(MockEngine):
    """The mock engine, counting its steps (a clock for the batcher that does not depend on load)."""

    steps = 0

    def generate(self, state):
        self.steps += 1
        return super().generate(state)


def test_cancel_frees_the_slot_at_once():
    eng = CountingMock(1, step_s=0.02)
    b = Batcher(eng).start()
    long = Collect()
    rid = b.submit(_req("y" * 200, max_tokens=250), long)  # 201 steps
    long.events.get(timeout=5)  # it is running
    b.cancel(rid)
    at_cancel = eng.steps
    short = Collect()
    b.submit(_req("hi"), short)
    text, _ev = short.result(timeout=30)
    # "hi" and its EOS take 2 steps; a slot held until the long reply's end would take ~200 more
    assert text == "hi" and eng.steps - at_cancel <= 10, eng.steps - at_cancel
    assert long.result()[1].finish_reason == "cancelled"
    b.stop()


def test_cancel_frees_a_queue_place_at_once():
    """A queued request that is cancelled leaves the queue in `cancel` itself, so a submit right
    after it finds the place free (no wait for the batcher's next loop)."""
    b = Batcher(MockEngine(1, step_s=0.02), max_queue=1).start()
    running = Collect()
    b.submit(_req("y" * 100), running)
    running.events.get(timeout=5)  # it holds the only slot
    queued = Collect()
    rid = b.submit(_req("queued"), queued)
    with pytest.raises(QueueFull):
        b.submit(_req("no place"), Collect())
    b.cancel(rid)
    assert queued.result(timeout=0.5)[1].finish_reason == "cancelled"
    b.submit(_req("next"), Collect())  # the place is free now
    b.stop(drain=False)


def test_stop_drains_then_refuses():
    b = Batcher(MockEngine(2, step_s=0.005)).start()
    sinks = [Collect() for _ in range(4)]
    for i, s in enumerate(sinks):
        b.submit(_req(f"reply {i}"), s)
    b.stop(drain=True, timeout=10)
    assert [s.result(timeout=1)[0] for s in sinks] == [f"reply {i}" for i in range(4)]
    with pytest.raises(ServerClosed):
        b.submit(_req("late"), Collect())


def _serve_all(engine, reqs, overlap):
    """Submit every request at once to a fresh batcher; (text, token ids, finish reason, completion tokens) each."""
    b = Batcher(engine, overlap=overlap).start()
    sinks = [Collect() for _ in reqs]
    for r, s in zip(reqs, sinks):
        b.submit(GenerationRequest(prompt=r.prompt, params=r.params, stop=r.stop), s)
    out = []
    for s in sinks:
        ids, text = [], []
        while True:
            ev = s.events.get(timeout=60)
            text.append(ev.text)
            ids += ev.token_ids
            if ev.finish_reason is not None:
                break
        out.append(("".join(text), ids, ev.finish_reason, ev.usage["completion_tokens"]))
    b.stop()
    return out, b.stats


def test_overlapped_steps_give_every_request_the_same_tokens():
    """With overlap the next step starts before the host work on the last one; requests that a
    stop string, max_tokens or a stop token end get exactly what they get without it, and a
    request that a stop string ends while a step is in flight gets none of that step's tokens."""
    from relf_jax.serving.engines import AREngine
    from tests._serving import tiny_lm

    engine = AREngine(tiny_lm("ar", max_seq_len=64), 4, steps_per_call=2)
    texts = ["hello there", "hi", "what is the weather", "tell me more", "ok", "bye now"]
    reqs = [GenerationRequest(prompt=[TOK.bos_id] + TOK.encode(f"<user> {t} <assistant>"),
                              params=RequestParams(max_tokens=9 + 3 * i, temperature=1.0, seed=i))
            for i, t in enumerate(texts)]
    free, _ = _serve_all(engine, reqs, overlap=False)
    for r, (text, *_rest) in zip(reqs[::2], free[::2]):  # every other request: a stop string from its reply
        r.stop = (text[5:7],) if len(text) >= 8 and text[5:7].strip() else ()
    assert any(r.stop for r in reqs)
    want, stats_off = _serve_all(engine, reqs, overlap=False)
    got, stats_on = _serve_all(engine, reqs, overlap=True)
    assert got == want
    assert stats_off.overlapped == 0 and stats_on.overlapped > 0
    assert Batcher(engine).overlap and not Batcher(MockEngine(1)).overlap  # the defaults
    for r, (text, _, reason, _) in zip(reqs, want):
        if r.stop:
            assert reason == "stop" and r.stop[0] not in text


def test_collect_counts_host_work_as_model_time_only_while_the_step_ran(monkeypatch):
    """`Pending`'s timing rule: a step still running when collected is model time from its
    dispatch; one already finished counts only its dispatch and copy. On a fake clock (each
    reading 0.5 s after the last), so the sums are exact."""
    import jax.numpy as jnp
    import numpy as np

    from relf_jax.serving.engine_api import Pending
    from relf_jax.serving.engines.slots import collect_rows

    class Running:  # a step that had not finished at the collect call
        def is_ready(self):
            return False

        def __array__(self, dtype=None, copy=None):
            return np.zeros((1, 1, 3), np.int32)

    done = jnp.zeros((1, 1, 3), jnp.int32).block_until_ready()
    readings = []

    def clock():
        readings.append(100.0 + 0.5 * len(readings))
        return readings[-1]

    monkeypatch.setattr(time, "perf_counter", clock)
    rows, model_s, early = collect_rows(Pending(Running(), None, 10.0, 10.25), 1)
    assert rows == [[[0, 0, 0]]] and not early and model_s == readings[-1] - 10.0  # from the dispatch on
    readings.clear()
    rows, model_s, early = collect_rows(Pending(done, None, 10.0, 10.25), 1)
    assert rows == [[[0, 0, 0]]] and early
    assert model_s == 0.25 + (readings[-1] - readings[0])  # the dispatch and the copy only
