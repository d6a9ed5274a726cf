"""The OpenAI-compatible server: the official client, concurrency, bad input, disconnects, fuzzing, SIGTERM."""

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

from relf_jax.methods import Autoregressive
from relf_jax.serving.batching import Batcher
from relf_jax.serving.chat_template import ChatTemplate
from relf_jax.serving.engines import AREngine
from relf_jax.serving.loading import ServedEngine
from tests._serving import ROOT_DIR, free_port, live_server, mock_models, tiny_lm, wait_until

USER = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server():
    engine = AREngine(tiny_lm("ar", max_seq_len=64), 4)
    engine.warmup([20])
    models = {"tiny": [ServedEngine(engine, Batcher(engine).start(), ChatTemplate(), Autoregressive(), {})],
              **mock_models(4, step_s=0.001)}
    with live_server(models) as base:
        yield base


def test_openai_client_chat_stream_usage_stop_and_seed(server):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert {m.id for m in client.models.list().data} == {"tiny", "mock"}
    r = client.chat.completions.create(model="mock", messages=USER)
    assert r.choices[0].message.content == "hello world" and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == 1 + 2 + len(" hello world ")  # BOS, the two markers, the bytes
    assert r.usage.completion_tokens == len("hello world") + 1
    pieces, usage, finish = [], None, None
    for chunk in client.chat.completions.create(model="mock", messages=USER, stream=True,
                                                stream_options={"include_usage": True}, stop=[" wor"]):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(pieces) == "hello" and finish == "stop" and usage.completion_tokens >= 5
    # a real model: the same seed gives the same reply, streamed or not; max_tokens bounds it
    kw = {"model": "tiny", "messages": USER, "temperature": 1.0, "max_tokens": 12}
    a = client.chat.completions.create(seed=7, **kw)
    b = client.chat.completions.create(seed=7, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(seed=7, stream=True, **kw) if c.choices)
    c = client.chat.completions.create(seed=8, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content == streamed
    assert a.usage.completion_tokens <= 12 and a.usage.completion_tokens >= 1
    assert c.choices[0].message.content != a.choices[0].message.content
    comp = client.completions.create(model="mock", prompt="<user> abc <assistant>", max_tokens=2)
    assert comp.choices[0].text == "ab" and comp.choices[0].finish_reason == "length"


def test_64_concurrent_streaming_clients(server):
    async def one(client, i):
        text = f"client {i} says hi"
        lines = []
        async with client.stream("POST", f"{server}/v1/chat/completions",
                                 json={"model": "mock", "stream": True,
                                       "messages": [{"role": "user", "content": text}]}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[len("data: "):]) for x in lines[:-1]]
        assert all(x.startswith("data: ") for x in lines)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert all(asyncio.run(main()))


BAD = [
    ("malformed json", b'{"model": "mock", "messages": [', 400),
    ("unknown model", {"model": "nope", "messages": USER}, 404),
    ("messages not a list", {"model": "mock", "messages": "hi"}, 400),
    ("temperature a string", {"model": "mock", "messages": USER, "temperature": "hot"}, 400),
    ("max_tokens zero", {"model": "mock", "messages": USER, "max_tokens": 0}, 400),
    ("max_tokens past the context", {"model": "tiny", "messages": USER, "max_tokens": 1000}, 400),
    ("temperature < 0", {"model": "mock", "messages": USER, "temperature": -0.5}, 400),
    ("top_p zero", {"model": "mock", "messages": USER, "top_p": 0}, 400),
    ("top_p above one", {"model": "mock", "messages": USER, "top_p": 1.5}, 400),
    ("empty messages", {"model": "mock", "messages": []}, 400),
    ("bad role", {"model": "mock", "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("no model", {"messages": USER}, 400),
    ("n too large", {"model": "mock", "messages": USER, "n": 17}, 400),
    ("lone surrogate", {"model": "mock", "messages": [{"role": "user", "content": "a\ud800b"}]}, 400),
    ("lone surrogate raw", b'{"model": "mock", "messages": [{"role": "user", "content": "a\\udc00b"}]}', 400),
    ("invalid utf-8", b'{"model": "mock", "messages": [{"role": "user", "content": "a\xff\xfeb"}]}', 400),
    ("surrogate field name", {"model": "mock", "messages": USER, "x\ud800": 1}, 400),
    ("max_tokens a string", {"model": "mock", "messages": USER, "max_tokens": "5"}, 400),
    ("max_tokens a float", {"model": "mock", "messages": USER, "max_tokens": 5.0}, 400),
    ("n a string", {"model": "mock", "messages": USER, "n": "2"}, 400),
    ("seed a string", {"model": "mock", "messages": USER, "seed": "7"}, 400),
    ("stream a string", {"model": "mock", "messages": USER, "stream": "true"}, 400),
    ("logprobs a string", {"model": "mock", "messages": USER, "logprobs": "true"}, 400),
    ("top_logprobs without logprobs", {"model": "mock", "messages": USER, "top_logprobs": 2}, 400),
    ("logit_bias key not an id", {"model": "mock", "messages": USER, "logit_bias": {"abc": 1}}, 400),
    ("logit_bias value a string", {"model": "mock", "messages": USER, "logit_bias": {"5": "1"}}, 400),
    ("stop_token_ids strings", {"model": "mock", "messages": USER, "stop_token_ids": ["1"]}, 400),
    ("frequency_penalty out of range", {"model": "mock", "messages": USER, "frequency_penalty": 3}, 400),
    ("penalty on an engine without it", {"model": "mock", "messages": USER, "presence_penalty": 0.5}, 400),
    ("tools", {"model": "mock", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("response_format", {"model": "mock", "messages": USER, "response_format": {"type": "json_object"}}, 400),
    ("unknown field", {"model": "mock", "messages": USER, "frobnicate": 1}, 400),
    ("unserved generator", {"model": "mock", "messages": USER, "generator": "nsd"}, 400),
    ("oversized body", b'{"model": "mock", "messages": [], "pad": "' + b"x" * (2 << 20) + b'"}', 413),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_error_object_and_the_server_keeps_serving(server, name, body, status):
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()  # ASCII: lone surrogates travel as \u escapes, as any client sends them
    r = httpx.post(f"{server}/v1/chat/completions", timeout=30, content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    ok = httpx.post(f"{server}/v1/chat/completions", json={"model": "mock", "messages": USER}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "hello world"


def test_lean_route_answers_as_the_fastapi_stack_does():
    """Generation requests start on `LeanRoutes` (valid ones never reach FastAPI's stack); the
    answers, errors included, are those of a server without it, and every request is timed."""
    def http_count(base):
        line = [ln for ln in httpx.get(f"{base}/metrics").text.splitlines()
                if ln.startswith("relf_http_request_duration_seconds_count")]
        return int(line[0].split()[-1])

    mock_bad = [(n, b) for n, b, _ in BAD if not (isinstance(b, dict) and b.get("model") == "tiny")]
    cases = [(n, "/v1/chat/completions", b, "application/json") for n, b in mock_bad] + [
        ("past the mock's context", "/v1/chat/completions", {"model": "mock", "messages": USER, "max_tokens": 600},
         "application/json"),
        ("json as text/plain", "/v1/chat/completions", json.dumps({"model": "mock", "messages": USER}).encode(),
         "text/plain"),
        ("a json list", "/v1/completions", b"[1, 2]", "application/json; charset=utf-8"),
        ("chat", "/v1/chat/completions", {"model": "mock", "messages": USER, "max_tokens": 5, "stop": ["or"]},
         "application/json"),
        ("completion", "/v1/completions", {"model": "mock", "prompt": "abc def", "seed": 3}, "application/json"),
        ("stream", "/v1/chat/completions", {"model": "mock", "messages": USER, "stream": True,
                                            "stream_options": {"include_usage": True}}, "application/json")]

    def answers(base):
        out = []
        for name, path, body, ctype in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = httpx.post(base + path, content=content, headers={"content-type": ctype}, timeout=30)
            text = r.text
            for key in ("id", "created"):  # per response
                text = re.sub(rf'"{key}": ?("[^"]*"|\d+)', f'"{key}": 0', text)
            out.append((name, r.status_code, r.headers["content-type"], text))
        return out

    with live_server(mock_models(2)) as lean, live_server(mock_models(2), lean=False) as stack:
        got, want = answers(lean), answers(stack)
        assert got == want
        assert {status for _, status, _, _ in got} >= {200, 400, 404, 413}
        assert http_count(lean) == http_count(stack) == len(cases)
        # a chunked body past the limit (no content-length to refuse it by): 413 on the lean route
        r = httpx.post(f"{lean}/v1/chat/completions", content=iter([b'{"pad": "', b"x" * (1 << 20), b'"}']),
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        ok = httpx.post(f"{lean}/v1/chat/completions", json={"model": "mock", "messages": USER}, timeout=30)
        assert ok.json()["choices"][0]["message"]["content"] == "hello world"


def test_stream_ends_its_body_with_the_last_events():
    """The ASGI messages of a streamed reply: the headers first, then text, and the finish chunk,
    usage and [DONE] end the body in one message (no trailing empty one: one write less)."""
    from relf_jax.serving.http import create_app

    app = create_app(mock_models(1))
    body = json.dumps({"model": "mock", "stream": True, "stream_options": {"include_usage": True},
                       "messages": USER}).encode()
    sent, given = [], []

    async def receive():
        if not given:
            given.append(1)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected (it never disconnects)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert all(m["type"] == "http.response.body" for m in bodies)
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False]
    last = bodies[-1]["body"].decode()
    assert last.endswith("data: [DONE]\n\n") and '"finish_reason": "stop"' in last and '"usage": {' in last
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content") or ""
                   for m in bodies for ln in m["body"].decode().split("\n\n")
                   if ln.startswith("data: {") and json.loads(ln[6:])["choices"])
    assert text == "hello world"


def test_full_queue_429_and_disconnect_frees_the_slot():
    models = mock_models(1, step_s=0.02, max_queue=1)
    batcher = models["mock"][0].batcher
    with live_server(models) as base:
        long = {"model": "mock", "stream": True, "max_tokens": 200,
                "messages": [{"role": "user", "content": "z" * 180}]}  # ~3.6 s of steps
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{base}/v1/chat/completions", json=long) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)  # it holds the only slot
                with httpx.Client(timeout=30) as c2, c2.stream("POST", f"{base}/v1/chat/completions",
                                                              json=long) as queued:
                    assert queued.status_code == 200
                    wait_until(lambda: batcher.queue_length() == 1)  # the second one waits in the queue (bound 1)
                    full = httpx.post(f"{base}/v1/chat/completions", json={"model": "mock", "messages": USER})
                    assert full.status_code == 429 and full.headers["retry-after"] == "1"
                    assert full.json()["error"]["type"] == "rate_limit_error"
                # both streams closed mid-way: their slot and queue place are freed at once
            at_close = batcher.stats.steps
            ok = httpx.post(f"{base}/v1/chat/completions", json={"model": "mock", "messages": USER}, timeout=30)
            # "hello world" and its EOS take 12 steps; the queued long reply alone would hold the slot 181
            assert ok.status_code == 200 and batcher.stats.steps - at_close < 150, batcher.stats.steps - at_close
        metrics = httpx.get(f"{base}/metrics").text
        assert 'relf_requests_total{model="mock",generator="mock",reason="cancelled"} 2.0' in metrics
        assert 'relf_rejected_total{model="mock",generator="mock"} 1.0' in metrics
        assert "relf_ttft_seconds_count" in metrics and "relf_queue_length" in metrics
        assert all(f"{m}{{model=\"mock\",generator=\"mock\"}} 0" in metrics  # the mock engine steps synchronously
                   for m in ("relf_overlapped_steps_total", "relf_overlapped_steps_ready_early_total"))
        # server-side seconds of generation requests (RequestTimer): counted, and positive
        count = [ln for ln in metrics.splitlines() if ln.startswith("relf_http_request_duration_seconds_count")]
        total = [ln for ln in metrics.splitlines() if ln.startswith("relf_http_request_duration_seconds_sum")]
        assert int(count[0].split()[-1]) >= 3 and float(total[0].split()[-1]) > 0
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_sjf_cost_prediction_runs_off_the_event_loop():
    """An SJF server predicts each request's cost (a model call) at submit; that happens in a
    worker thread, so the server keeps answering while a slow prediction runs."""
    from relf_jax.serving.scheduler import make_policy

    calls, inside, release = [], threading.Event(), threading.Event()

    def slow_cost(prompt):
        calls.append(len(prompt))
        inside.set()
        release.wait(timeout=30)  # held until the test has had its answer
        return {"dws_cost": float(len(prompt))}

    models = mock_models(1, policy=make_policy("sjf:dws_cost", aging=0.0), cost_fn=slow_cost)
    with live_server(models) as base, httpx.Client(timeout=30) as client:
        done = {}
        worker = threading.Thread(target=lambda: done.setdefault("r", client.post(
            f"{base}/v1/chat/completions", json={"model": "mock", "messages": USER})))
        worker.start()
        try:
            assert inside.wait(timeout=30)  # the request is inside its cost prediction
            # answered while the prediction is held (a blocked event loop would time this out)
            assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
        finally:
            release.set()
        worker.join(timeout=30)
        assert done["r"].status_code == 200 and done["r"].json()["choices"][0]["message"]["content"] == "hello world"
        assert calls == [1 + 2 + len(" hello world ")]


def test_schemathesis_finds_no_server_errors(server):
    import hypothesis
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    labels = []
    for result in schema.get_all_operations():
        op = result.ok()
        labels.append(op.label)

        @hypothesis.settings(max_examples=25, deadline=None, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=op.as_strategy())
        def check(case):
            r = case.call(base_url=server, timeout=30)
            assert r.status_code < 500, (case.body, r.text)

        check()
    assert "POST /v1/chat/completions" in labels and "GET /metrics" in labels


def test_sigterm_drains_in_flight_requests_then_exits():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "experiments.launch", "serve", "--mock", "--mock-step-ms", "20",
                             "--port", str(port), "--log-level", "warning"], cwd=ROOT_DIR,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def up():
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=60, what="the server's /health")
        text = "drain me " * 5
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", timeout=30,
                          json={"model": "mock", "stream": True,
                                "messages": [{"role": "user", "content": text}]}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)  # ~0.9 s of the reply is still to come
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]"
        body = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or "" for x in [first] + rest[:-1])
        assert body == text.strip()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_load_generator_against_the_mock_server():
    """`relf-jax bench serve`'s load generator (its own process) and its summary, on a live mock server."""
    from experiments.bench.serve_client import run_load, summarize_run
    from relf_jax.serving.simulator import poisson_arrivals

    with live_server(mock_models(2, step_s=0.002)) as base:
        bodies = [{"model": "mock", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8,
                   "messages": [{"role": "user", "content": f"request {i}"}]} for i in range(12)]
        bodies.append({"model": "nope", "stream": True, "messages": USER})  # one error, counted
        res = run_load(f"{base}/v1/chat/completions", bodies, poisson_arrivals(50.0, len(bodies), 0))
    s = summarize_run(res["records"], res["wall_s"])
    assert [r["text"] for r in res["records"][:12]] == [f"request {i}"[:8] for i in range(12)]
    assert {r["finish"] for r in res["records"][:12]} == {"length"}  # 9+ bytes + EOS > max_tokens 8
    assert s["requests"] == 13 and s["errors"] == 1 and s["error_kinds"] == ["HTTP 404"]
    assert s["output_tokens"] == sum(min(8, len(f"request {i}") + 1) for i in range(12))
    assert 0 < s["ttft_p50"] <= s["e2e_p50"] <= s["e2e_p99"] and s["output_tokens_per_s"] > 0


def test_bench_batcher_capacity_on_mock_engines():
    """`bench serve`'s in-process capacity runs: every request finishes, its tokens are counted,
    and the rates are the runs' counts over their own time (comparing engines' speeds is the
    bench's job, not a test's)."""
    from experiments.bench.serve import SPEC_ENGINES
    from experiments.bench.serve_batcher import batcher_capacity, engine_kw
    from relf_jax.serving.engine_api import RequestParams
    from relf_jax.serving.engines import MockEngine

    assert engine_kw(dict(SPEC_ENGINES)["nsd_ngram"]) == ("nsd", {"proposer": "corpus_ngram"})
    assert engine_kw(dict(SPEC_ENGINES)["ar"]) == ("ar", {})
    slow, fast = MockEngine(2, step_s=0.004), MockEngine(2, step_s=0.0005)
    batchers = {"ar": Batcher(slow).start(), "nsd": Batcher(fast).start()}
    tok = slow.tokenizer
    requests = [([tok.bos_id] + tok.encode(f"<user> reply {i} <assistant>"), RequestParams(32, 1.0, 1.0, i))
                for i in range(6)]
    try:
        out = batcher_capacity(batchers, requests, 2)
    finally:
        for b in batchers.values():
            b.stop()
    tokens = sum(len(slow.reply_for(p)) for p, _ in requests)  # the reply and its EOS
    for name in ("ar", "nsd"):
        assert [r["output_tokens"] for r in out[name]["runs"]] == [tokens, tokens] and out[name]["errors"] == 0
        assert out[name]["tokens_per_request"] == tokens / 6
        # the rates are the runs' counts over their own wall time, and the reported one their median
        runs = out[name]["runs"]
        for r in runs:
            assert r["output_tokens_per_s"] == r["output_tokens"] / r["wall_s"]
            assert r["requests_per_s"] == 6 / r["wall_s"]
        assert out[name]["output_tokens_per_s"] == float(np.median([r["output_tokens_per_s"] for r in runs]))


def test_bench_lean_route_comparison_on_mock_servers(tmp_path):
    """`bench serve`'s side-by-side batch-1 runs of the normal server against `serve
    --no-lean-routes` and `serve --overlap off`."""
    from experiments.bench.serve_servers import ServerProcess, batch1_run, lean_route_batch1

    bodies = [{"model": "mock", "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": f"hi {i}"}]}
              for i in range(4)]
    args = ["--mock", "--mock-step-ms", "1", "--model-name", "mock"]
    with ServerProcess(args, str(tmp_path / "lean.log")) as lean:
        first = batch1_run(lean, bodies)
        # one variant of the bench's two: each is one more server process, and the loop is the same
        out = lean_route_batch1(lean, first, {"stack": ([*args, "--no-lean-routes"], str(tmp_path / "stack.log"))},
                                 bodies, 2)
    names = ("lean", "stack")
    assert [len(out[k]["server_ms"]) for k in names] == [3, 2]
    assert all(ms > 0 for k in names for ms in out[k]["server_ms"])
    assert all(out[f"{k}_over_lean_{m}"] > 0 for k in names[1:] for m in ("server_ms", "e2e"))
    assert set(out["median_server_overhead_share"]) == set(names)


def test_streamed_multibyte_characters_stay_whole(server):
    """The mock engine emits one UTF-8 byte per step: a delta never holds a partial character."""
    text = "héllo wörld € 😀 ok"
    deltas = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=30,
                      json={"model": "mock", "stream": True, "messages": [{"role": "user", "content": text}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas) and sum(bool(d) for d in deltas) > 5
