"""`relf-jax bench serve`: the live server under a Poisson load, measured from the client.

Composition only. It starts `relf-jax serve` subprocesses on 127.0.0.1 and drives each with a
load generator in its own process (`load_child`: asyncio + httpx, open-loop Poisson arrivals,
a fixed number of streaming chat requests built from `synthetic_chat` and `chatterbot`
prompts). Every request records its time to first token (TTFT), time per output token after
the first (TPOT), end-to-end latency and its output tokens (the server's usage report);
a run reports p50/p99 of each, the mean latency, output tokens/s over the run, and errors.

Three comparisons, each side by side in one run (parts "engines": 1 and 2, "batcher": the
second half of 1, "dws": 3):

1. **AR vs NSD speculative engines** (same model, `slots` slots, FCFS; NSD with its distilled
   draft, with the prompt-lookup proposer and with the corpus n-gram table): the same request stream at several rates,
   multiples of the AR engine's batch-1 request rate; reports each NSD / AR ratio of output
   tokens/s at each rate, and the replies' quality (NSD is lossy): gen PPL of each reply given
   its prompt under the exact `synthetic_chat` judge, entropy, length.
   **The same engines without the server** (part "batcher", `batcher_capacity`): each engine
   behind its `Batcher` in the bench's own process, the same requests all queued at once, runs
   taken in turn across the engines. Output tokens/s and requests/s there are what the engines
   and the batcher allow, with no HTTP and no client on the machine: the ceiling of the NSD / AR
   ratios measured through the server.
2. **Server overhead at batch 1**: requests sent one after another; the share of the
   client-measured end-to-end time that was not spent in engine prefill/steps (the server's
   ``relf_model_seconds_total`` counter, read from /metrics before and after). For AR, also
   side by side against a server started with ``--no-lean-routes`` (every request through
   FastAPI's whole stack) and one started with ``--overlap off`` (no engine step starts before
   the host work on the last one ends), runs going round the three (`_lean_route_batch1`).
3. **FCFS vs SJF-DWS** on the block-diffusion engine with one slot (a non-preemptive server,
   where the discrete-event simulator is exact), both policies in one server process, each
   its own engine: every prompt is first timed alone (batch 1), then one Poisson stream is
   served by both policies at once (each request goes to both at the same moment: a paired
   comparison under the same machine noise), `dws_reps` times, at loads around and above
   saturation; the measured FCFS / SJF mean-latency ratio is reported next to the
   simulator's prediction from the batch-1 times (`relf_jax.serving.simulator`). Loads are
   fractions of each policy's capacity with both running, measured in a run at twice that
   (the batch-1 rate); the simulator's service times are the batch-1 times scaled to it. SJF
   ranks by the DWS predictor's cost (`relf_jax.dws.predictor.WorkloadCost`, from ``relf-jax
   bench dws``), scored as each request arrives (`relf_jax.serving.batching`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class ServeBenchSizes:
    preset: str = "cpu"
    requests: int = 160  # per run (AR / NSD)
    rate_factors: tuple[float, ...] = (1.0, 4.0, 16.0)  # x the AR engine's batch-1 request rate
    slots: int = 8
    k: int = 4
    max_tokens: int = 64
    temperature: float = 1.0
    batch1_requests: int = 48
    lean_route_reps: int = 3  # AR batch-1 runs on each of the lean and the FastAPI-stack servers (alternating)
    batcher_reps: int = 3  # in-process capacity runs per engine (`batcher_capacity`), taken in turn
    dws_requests: int = 400
    dws_loads: tuple[float, ...] = (0.9, 1.2)
    dws_reps: int = 3  # runs per load (each drives both policies at once)
    dws_max_tokens: int = 96
    max_context: int | None = None  # AR / NSD engines: `relf-jax serve --max-context` (None: the model's)
    dws_aging_horizon: float = 100.0  # in mean predicted costs: one size spread gained per this many
    seed: int = 0


# the engines compared on one request stream: name -> `relf-jax serve` arguments
SPEC_ENGINES = (("ar", ["--generator", "ar"]),
                ("nsd", ["--generator", "nsd", "--proposer", "draft"]),
                ("nsd_lookup", ["--generator", "nsd", "--proposer", "prompt_lookup"]),
                ("nsd_ngram", ["--generator", "nsd", "--proposer", "corpus_ngram"]))

QUICK = ServeBenchSizes(preset="tiny", requests=48, rate_factors=(1.0, 8.0), batch1_requests=8, lean_route_reps=1,
                        batcher_reps=1,
                        dws_requests=48,
                        dws_loads=(1.2,), dws_reps=1, max_tokens=32, dws_max_tokens=48)


# ----------------------------------------------------------------------------- load generator

def _pct(x, q):
    return float(np.percentile(x, q)) if len(x) else None


def summarize_run(records: list[dict], wall_s: float) -> dict:
    """p50/p99 TTFT, TPOT and latency, mean latency, output tokens/s and errors of one run."""
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["ttft"] is not None and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    return {"requests": len(records), "errors": len(records) - len(ok),
            "error_kinds": sorted({r["error"] for r in records if r["error"]})[:5],
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
            "e2e_p50": _pct(e2e, 50), "e2e_p99": _pct(e2e, 99), "e2e_mean": float(np.mean(e2e)) if e2e else None,
            "output_tokens": tokens, "wall_s": wall_s, "output_tokens_per_s": tokens / max(wall_s, 1e-9),
            "requests_per_s": len(ok) / max(wall_s, 1e-9)}


async def _one(client, url: str, body: dict, at: float, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    sent = time.perf_counter()
    rec = {"arrival": at, "ttft": None, "e2e": None, "tokens": 0, "error": None, "text": "", "finish": None}
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}"
                await r.aread()
                return rec
            done = False
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    rec["error"] = "malformed SSE line"
                    break
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec["error"] = "error event"
                    break
                if obj.get("usage"):
                    rec["tokens"] = obj["usage"]["completion_tokens"]
                piece = obj["choices"][0]["delta"].get("content") if obj["choices"] else None
                if piece:
                    rec["text"] += piece
                    if rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - sent
                if obj["choices"] and obj["choices"][0].get("finish_reason"):
                    rec["finish"] = obj["choices"][0]["finish_reason"]
            if not done and rec["error"] is None:
                rec["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - a failed request is a measured error
        rec["error"] = type(e).__name__
    rec["e2e"] = time.perf_counter() - sent
    return rec


def load_child(spec: dict) -> dict:
    """Run one load: spec = {url, model, bodies: [chat bodies], arrivals: [s] or None (one after another)}."""
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=spec.get("max_connections", 512))
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            t0 = time.perf_counter()
            if spec["arrivals"] is None:  # closed loop, batch 1
                recs = []
                for body in spec["bodies"]:
                    recs.append(await _one(client, spec["url"], body, 0.0, time.perf_counter()))
            else:
                recs = await asyncio.gather(*(_one(client, spec["url"], b, a, t0)
                                              for b, a in zip(spec["bodies"], spec["arrivals"])))
            return list(recs), time.perf_counter() - t0

    records, wall = asyncio.run(main())
    return {"records": records, "wall_s": wall}


def _run_load(url: str, bodies: list[dict], arrivals: Sequence[float] | None) -> dict:
    """The load generator in its own process; returns its records and wall time."""
    spec = {"url": url, "bodies": bodies, "arrivals": None if arrivals is None else [float(a) for a in arrivals]}
    code = ("import json, sys; from experiments.bench_serve import load_child; "
            "print(json.dumps(load_child(json.loads(sys.stdin.read()))))")
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- without the server

def _engine_kw(args: Sequence[str]) -> tuple[str, dict]:
    """(generator, `load_engine` keywords) of a `SPEC_ENGINES` argument list."""
    opts = dict(zip(args[::2], args[1::2]))
    return opts.pop("--generator"), {k.lstrip("-").replace("-", "_"): v for k, v in opts.items()}


def _drain(batcher, requests: list) -> dict:
    """Queue every request in `requests` (prompt ids, `RequestParams`) at once on a started
    `Batcher`; wait for all of them: output tokens/s and requests/s over that time."""
    import threading

    from relf_jax.serving.batching import GenerationRequest

    done, lock = threading.Semaphore(0), threading.Lock()
    totals = {"tokens": 0, "errors": 0}

    def sink(ev):
        if ev.finish_reason is None:
            return
        with lock:
            if ev.finish_reason in ("stop", "length"):
                totals["tokens"] += ev.usage["completion_tokens"]
            else:
                totals["errors"] += 1
        done.release()

    t0 = time.perf_counter()
    for prompt, params in requests:
        batcher.submit(GenerationRequest(prompt=list(prompt), params=params), sink)
    for _ in requests:
        done.acquire()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": totals["tokens"], "errors": totals["errors"],
            "output_tokens_per_s": totals["tokens"] / wall, "requests_per_s": len(requests) / wall}


def batcher_capacity(batchers: dict, requests: list, reps: int) -> dict:
    """Each engine's capacity without the server: `requests` all queued at once on its `Batcher`
    in this process (no HTTP, no client), `reps` runs taken in turn across the engines so that
    they share the machine's noise. Per engine: the runs, and the median output tokens/s,
    requests/s and tokens per request; the NSD / AR ratios are what the engines and batcher
    alone allow, the ceiling of the ratios measured through the server."""
    runs = {name: [] for name in batchers}
    for _ in range(reps):
        for name, batcher in batchers.items():
            runs[name].append(_drain(batcher, requests))
    out = {}
    for name, rs in runs.items():
        out[name] = {"runs": rs, "errors": sum(r["errors"] for r in rs),
                     "output_tokens_per_s": float(np.median([r["output_tokens_per_s"] for r in rs])),
                     "requests_per_s": float(np.median([r["requests_per_s"] for r in rs])),
                     "tokens_per_request": rs[0]["output_tokens"] / max(len(requests), 1)}
    return out


# ----------------------------------------------------------------------------- servers

class ServerProcess:
    """`relf-jax serve ARGS` on a free 127.0.0.1 port; ready once /health answers."""

    def __init__(self, args: list[str], log_path: str, ready_timeout_s: float = 900.0, child_spec: dict | None = None):
        import httpx

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        if child_spec is None:
            cmd = [sys.executable, "-m", "experiments.launch", "serve", "--port", str(self.port), "--log-level",
                   "warning", *args]
        else:
            cmd = [sys.executable, "-c", ("import json, sys; from experiments.bench_serve import policies_server_child; "
                   "policies_server_child(json.loads(sys.argv[1]))"), json.dumps({**child_spec, "port": self.port})]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server did not start in {ready_timeout_s} s; see {log_path}")
            time.sleep(0.5)

    def metric(self, name: str) -> float:
        import httpx

        total = 0.0
        for line in httpx.get(f"{self.base}/metrics", timeout=10).text.splitlines():
            if line.startswith((name + "{", name + " ")):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def policies_server_child(spec: dict) -> None:
    """A server with one block-diffusion engine per policy, as model ids "fcfs" and "sjf" (SJF on
    the DWS predicted cost, with `spec["aging"]`): what `relf-jax serve --policy ...` builds, twice."""
    from relf_jax import workflows
    from relf_jax.dws.predictor import WorkloadCost
    from relf_jax.serving.server import build_models, serve

    cost = WorkloadCost(workflows.load_model(spec["predictor"], "dws"), spec["cost_model"])
    models = {}
    for policy in ("fcfs", "sjf"):
        models.update(build_models(spec["workdir"], ["bd"], model_name=policy, slots=1, max_queue=spec["max_queue"],
                                   policy=policy, aging=spec["aging"], cost_fn=cost if policy == "sjf" else None))
    serve(models, host="127.0.0.1", port=spec["port"], log_level="warning")


def _bodies(prompts, model: str, *, max_tokens: int, temperature: float, seed: int) -> list[dict]:
    out = []
    for i, p in enumerate(prompts):
        content = p.text.replace("<user>", " ").replace("<assistant>", " ").strip()
        out.append({"model": model, "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                    "temperature": temperature, "seed": seed + i})
    return out


def reply_quality(judge, prompts: Sequence[str], records: list[dict]) -> dict:
    """Gen PPL of the replies given their prompts under the exact judge (reply words, scored as
    a prefix: a reply may end where the next turn begins), mean unigram entropy and length."""
    from relf_jax.eval.metrics import mean_unigram_entropy

    ok = [(p, r["text"]) for p, r in zip(prompts, records) if r["error"] is None]
    logp, n = judge.score_replies([p for p, _ in ok], [t for _, t in ok], [False] * len(ok))
    return {"gen_ppl": float(np.exp(-logp.sum() / max(n.sum(), 1))),
            "entropy": mean_unigram_entropy([judge.tokenize(t) for _, t in ok]),
            "reply_words": float(np.mean([len(t.split()) for _, t in ok])), "replies": len(ok)}


def _batch1(server: ServerProcess, bodies: list[dict]) -> dict:
    """Requests one after another: latency and the share of it spent outside the engine.

    overhead_share: 1 - engine seconds / client-measured e2e (everything that is not a model
    step, the HTTP client and the loopback included); server_overhead_share: (server-side
    request seconds - engine seconds) / client e2e, the server's own part of it.
    """
    m0 = server.metric("relf_model_seconds_total")
    h0 = server.metric("relf_http_request_duration_seconds_sum")
    res = _run_load(f"{server.base}/v1/chat/completions", bodies, None)
    model_s = server.metric("relf_model_seconds_total") - m0
    server_s = server.metric("relf_http_request_duration_seconds_sum") - h0
    recs = res["records"]
    e2e = sum(r["e2e"] for r in recs if r["error"] is None)
    return {**summarize_run(recs, res["wall_s"]), "model_s": model_s, "client_e2e_s": e2e, "server_s": server_s,
            "overhead_share": 1.0 - model_s / max(e2e, 1e-9),
            "server_overhead_share": (server_s - model_s) / max(e2e, 1e-9), "records": recs}


def _lean_route_batch1(lean: ServerProcess, first: dict, variants: dict[str, tuple[list[str], str]], bodies: list[dict],
                       reps: int) -> dict:
    """Batch-1 server overhead of the normal server (`lean`, whose first batch-1 run is `first`)
    side by side with other servers on the same model, ``variants`` {name: (serve args, log
    path)} -- the bench runs "stack" (``--no-lean-routes``: FastAPI's whole stack) and
    "no_overlap" (``--overlap off``: no engine step starts before the host work on the last one ends).
    Runs go round the servers, `reps` each after `first`, in mirrored orders.

    server_ms: the server's own milliseconds per request (its request seconds minus model
    seconds); <name>_over_lean_server_ms and <name>_over_lean_e2e: ratios of the medians (server
    ms, and the client's mean e2e); median_server_overhead_share per server."""
    runs: dict[str, list[dict]] = {"lean": [first], **{name: [] for name in variants}}
    with contextlib.ExitStack() as stack:
        servers = {"lean": lean}
        for name, (args, log_path) in variants.items():
            servers[name] = stack.enter_context(ServerProcess(args, log_path))
            _batch1(servers[name], bodies[:4])  # warm its connection and first requests, as `first` had
        names = list(servers)
        for i in range(reps):
            for name in names[::-1] if i % 2 == 0 else names:  # mirrored: ABC, CBA, ...
                runs[name].append(_batch1(servers[name], bodies))
    out: dict = {}
    for name, rs in runs.items():
        ms = [(r["server_s"] - r["model_s"]) / max(r["requests"], 1) * 1e3 for r in rs]
        out[name] = {"server_ms": ms, "server_overhead_share": [r["server_overhead_share"] for r in rs],
                     "e2e_mean_ms": [r["e2e_mean"] * 1e3 for r in rs]}
    for name in variants:
        out[f"{name}_over_lean_server_ms"] = float(np.median(out[name]["server_ms"]) / np.median(out["lean"]["server_ms"]))
        out[f"{name}_over_lean_e2e"] = float(np.median(out[name]["e2e_mean_ms"]) / np.median(out["lean"]["e2e_mean_ms"]))
    out["median_server_overhead_share"] = {k: float(np.median(out[k]["server_overhead_share"])) for k in runs}
    return out


# ----------------------------------------------------------------------------- the benchmark

def _ensure_models(workdir: str, preset: str, overrides: Sequence[str]):
    from experiments.bench import draft_steps
    from relf_jax import workflows
    from relf_jax.config import make_config

    cfg = make_config(preset, list(overrides), workdir=workdir)
    workflows.train_lm(cfg)
    workflows.train_draft(cfg.workdir, [f"train.steps={draft_steps(cfg)}"])
    return cfg


def _ensure_dws(workdir: str, quick: bool) -> tuple[str, str]:
    """(surface predictor dir, bench dws JSON) under <workdir>/dws, made by `bench dws` if missing."""
    dws_dir = os.path.join(workdir, "dws")
    report = os.path.join(workdir, "dws.json")

    def headline():  # the predictor of the report's "dws" row; else the newest surface predictor
        if not os.path.isfile(report):
            return None
        with open(report) as f:
            named = json.load(f).get("predictor_dir")
        if named and os.path.isdir(named):
            return named
        for name in ("surface_length", "surface"):
            found = sorted(glob.glob(os.path.join(dws_dir, "predictor_*", name)), key=os.path.getmtime)
            if found:
                return found[-1]
        return None

    if headline() is None:
        from experiments.bench_dws import bench_dws

        print(f"[bench serve] no DWS predictor in {dws_dir}: running bench dws (writes {report})", flush=True)
        bench_dws(report, quick=quick, workdir=dws_dir)
    return headline(), report


PARTS = ("engines", "batcher", "dws")


def bench_serve(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
                sizes: ServeBenchSizes | None = None, parts: Sequence[str] = PARTS) -> dict:
    """Runs the comparisons named in `parts` ("engines": 1 + 2 of the module docstring; "batcher":
    the same engines' capacity without the server, `batcher_capacity`; "dws": 3) and writes the
    JSON to `out`."""
    from relf_jax import workflows
    from relf_jax.dws.predictor import WorkloadCost
    from relf_jax.dws.workload import workload_prompts
    from relf_jax.errors import UserError
    from relf_jax.serving.scheduler import FCFS, SJF, aging_for
    from relf_jax.serving.simulator import poisson_arrivals, simulate, summarize

    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise UserError(f"bench serve parts must be a non-empty subset of {', '.join(PARTS)}; got {list(parts)}")
    sz = sizes or (QUICK if quick else ServeBenchSizes())
    workdir = workdir or os.path.join("runs", f"bench_serve_{sz.preset}")
    os.makedirs(workdir, exist_ok=True)
    t_start = time.perf_counter()
    cfg = _ensure_models(workdir, sz.preset, overrides)
    judge = workflows.exact_judge(cfg)
    tok = workflows.load_model(workdir, "ar").tokenizer
    n_all = max(sz.requests, sz.batch1_requests, sz.dws_requests)
    prompts = workload_prompts(tok, n_synthetic=int(n_all * 0.8) + 1, n_chatterbot=n_all // 5 + 1,
                               seed=sz.seed + 1234)
    rng = np.random.default_rng(sz.seed)
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    result: dict = {"config": {**dataclasses.asdict(sz), "workdir": os.path.abspath(workdir), "parts": list(parts)}}
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)

    # --- 1 + 2: AR vs NSD, and batch-1 overhead
    if "engines" in parts:
        common = ["--workdir", workdir, "--slots", str(sz.slots), "--k", str(sz.k), "--model-name", "m"]
        if sz.max_context is not None:
            common += ["--max-context", str(sz.max_context)]
        engines = {}
        for gen, extra in SPEC_ENGINES:
            print(f"[bench serve] {gen} engine: starting the server", flush=True)
            with ServerProcess([*common, *extra], os.path.join(logs, f"serve_{gen}.log")) as srv:
                url = f"{srv.base}/v1/chat/completions"
                b1 = _batch1(srv, _bodies(prompts[:sz.batch1_requests], "m", max_tokens=sz.max_tokens,
                                          temperature=sz.temperature, seed=sz.seed))
                if gen == "ar":
                    base_rate = b1["requests"] / b1["wall_s"]
                    if sz.lean_route_reps > 0:  # before the loaded runs: every server compared is fresh
                        result["lean_route_batch1"] = _lean_route_batch1(
                            srv, b1, {"stack": ([*common, *extra, "--no-lean-routes"],
                                                os.path.join(logs, "serve_ar_stack.log")),
                                      "no_overlap": ([*common, *extra, "--overlap", "off"],
                                                     os.path.join(logs, "serve_ar_no_overlap.log"))},
                            _bodies(prompts[:sz.batch1_requests], "m", max_tokens=sz.max_tokens,
                                    temperature=sz.temperature, seed=sz.seed), sz.lean_route_reps)
                runs = {}
                bodies = _bodies(prompts[:sz.requests], "m", max_tokens=sz.max_tokens, temperature=sz.temperature,
                                 seed=sz.seed)
                for f in sz.rate_factors:
                    rate = f * base_rate
                    arrivals = poisson_arrivals(rate, sz.requests, sz.seed + 7)
                    res = _run_load(url, bodies, arrivals)
                    runs[f"{f:g}"] = {"rate_rps": rate, **summarize_run(res["records"], res["wall_s"]),
                                      "quality": reply_quality(judge, [p.text for p in prompts[:sz.requests]],
                                                               res["records"])}
                    print(f"[bench serve] {gen} x{f:g} ({rate:.2f} req/s): "
                          f"{runs[f'{f:g}']['output_tokens_per_s']:.0f} tok/s, "
                          f"mean e2e {runs[f'{f:g}']['e2e_mean']:.2f} s, errors {runs[f'{f:g}']['errors']}", flush=True)
                acc = srv.metric("relf_acceptance_length")
                engines[gen] = {"batch1": {k: v for k, v in b1.items() if k != "records"}, "rates": runs,
                                "acceptance_length": acc}
        result["engines"] = engines
        for gen in engines:
            if gen != "ar":
                result[f"{gen}_over_ar_tokens_per_s"] = {
                    f: engines[gen]["rates"][f]["output_tokens_per_s"] / engines["ar"]["rates"][f]["output_tokens_per_s"]
                    for f in engines["ar"]["rates"]}
        result["overhead_share_batch1"] = {g: engines[g]["batch1"]["overhead_share"] for g in engines}
        result["server_overhead_share_batch1"] = {g: engines[g]["batch1"]["server_overhead_share"] for g in engines}

    # --- the same engines without the server: their capacity in this process
    if "batcher" in parts:
        from relf_jax.serving.chat import encode_chat
        from relf_jax.serving.engines import RequestParams
        from relf_jax.serving.server import build_models

        served = {}
        try:
            for gen, extra in SPEC_ENGINES:
                generator, kw = _engine_kw(extra)
                if sz.max_context is not None:
                    kw["max_context"] = sz.max_context
                print(f"[bench serve] {gen} engine in process: compiling", flush=True)
                with contextlib.redirect_stderr(sys.stdout):
                    served[gen] = build_models(workdir, [generator], model_name="m", slots=sz.slots, k=sz.k,
                                               **kw)["m"][0]
            one = served["ar"]  # every engine shares the model's tokenizer and template
            bodies = _bodies(prompts[:sz.requests], "m", max_tokens=sz.max_tokens, temperature=sz.temperature,
                             seed=sz.seed)
            requests = [(encode_chat(one.engine.tokenizer, one.template, b["messages"]),  # what the server makes of them
                         RequestParams(max_tokens=b["max_tokens"], temperature=b["temperature"],
                                       seed=b["seed"] % (2 ** 31))) for b in bodies]
            cap = batcher_capacity({gen: s.batcher for gen, s in served.items()}, requests, sz.batcher_reps)
        finally:
            for s in served.values():
                s.batcher.stop()
        for gen, r in cap.items():
            print(f"[bench serve] {gen} in process: {r['output_tokens_per_s']:.0f} tok/s, "
                  f"{r['requests_per_s']:.1f} req/s, {r['tokens_per_request']:.1f} tokens/request", flush=True)
        result["batcher"] = cap
        for gen in cap:
            if gen != "ar":
                result[f"batcher_{gen}_over_ar_tokens_per_s"] = (cap[gen]["output_tokens_per_s"]
                                                                 / cap["ar"]["output_tokens_per_s"])
                result[f"batcher_{gen}_over_ar_requests_per_s"] = (cap[gen]["requests_per_s"]
                                                                   / cap["ar"]["requests_per_s"])

    # --- 3: FCFS vs SJF-DWS on the block-diffusion engine, one slot
    if "dws" in parts:
        predictor_dir, dws_report = _ensure_dws(workdir, quick)
        bd_dir = os.path.join(workdir, "dws")
        cost = WorkloadCost(workflows.load_model(predictor_dir, "dws"), dws_report)
        bd_tok = workflows.load_model(bd_dir, "bd").tokenizer
        dws_prompts = prompts[:sz.dws_requests]
        predicted = np.asarray([c["dws_cost"] for c in cost.batch([[bd_tok.bos_id] + bd_tok.encode(p.text)
                                                                   for p in dws_prompts])])
        # one server process holds both policies (model ids "fcfs" and "sjf", each its own engine,
        # queue and batcher thread), and every run drives both at once with the same stream: each
        # request is sent to both at the same moment, so the two policies share the machine's
        # noise (its speed drifts by several per cent from run to run, and near saturation the
        # mean latency moves far more than that), and the ratio is a paired measurement
        aging = aging_for(predicted, sz.dws_aging_horizon * float(np.mean(predicted)))
        spec = {"workdir": bd_dir, "predictor": predictor_dir, "cost_model": dws_report, "aging": aging,
                "max_queue": 4 * sz.dws_requests}
        loads = {}

        def both(arrivals):
            """One load on both policies at once; returns {policy: (records, wall)}. Which of a
            pair is sent first alternates."""
            bodies = {p: _bodies(dws_prompts, p, max_tokens=sz.dws_max_tokens, temperature=0.0, seed=sz.seed)
                      for p in ("fcfs", "sjf")}
            order = [(("fcfs", "sjf") if i % 2 == 0 else ("sjf", "fcfs")) for i in range(len(dws_prompts))]
            flat = [(p, i) for i, pair in enumerate(order) for p in pair]
            res = _run_load(url, [bodies[p][i] for p, i in flat], [float(arrivals[i]) for _, i in flat])
            out = {}
            for p in ("fcfs", "sjf"):
                recs = [r for (q, _), r in zip(flat, res["records"]) if q == p]
                out[p] = (recs, max(r["arrival"] + (r["e2e"] or 0.0) for r in recs))
            return out

        print("[bench serve] bd engine, fcfs + sjf: starting the server", flush=True)
        with ServerProcess([], os.path.join(logs, "serve_bd.log"), child_spec=spec) as srv:
            url = f"{srv.base}/v1/chat/completions"
            # every prompt alone: the service times the simulator replays
            cal = _batch1(srv, _bodies(dws_prompts, "fcfs", max_tokens=sz.dws_max_tokens, temperature=0.0,
                                       seed=sz.seed))
            service = np.asarray([r["e2e"] for r in cal["records"]])
            first = np.asarray([min(r["ttft"] or r["e2e"], r["e2e"]) for r in cal["records"]])
            result["dws_batch1"] = {k: v for k, v in cal.items() if k != "records"}
            # each policy's capacity while both run, from a run that overloads both: the batch-1
            # rate, where each gets about half the machine (a burst of every request at once
            # instead measures the HTTP front end, not the steady state). A batch-1 time holds
            # client, HTTP and loopback time that overlaps model steps under load, and the two
            # engines share the CPU, so loads are fractions of this capacity and the simulator
            # replays the batch-1 times scaled to it (the same load on both sides)
            batch1_rps = 1.0 / float(np.mean(service))
            over = both(poisson_arrivals(batch1_rps, len(dws_prompts), sz.seed + 5))
            capacity = len(dws_prompts) / max(wall for _, wall in over.values())
            scale = 1.0 / (capacity * float(np.mean(service)))
            service, first = service * scale, first * scale
            calibration = {"capacity_rps": capacity, "service_scale": scale, "batch1_rps": batch1_rps,
                           "overload_run": {p: summarize_run(recs, wall) for p, (recs, wall) in over.items()}}
            print(f"[bench serve] bd capacity {capacity:.1f} req/s per policy with both running "
                  f"(batch-1 times x {scale:.2f})", flush=True)
            for load in sz.dws_loads:
                rate = load * capacity
                arrivals = poisson_arrivals(rate, len(dws_prompts), sz.seed + 11)
                entry = loads.setdefault(f"{load:g}", {"rate_rps": rate, "arrivals": arrivals})
                reps = [both(arrivals) for _ in range(sz.dws_reps)]
                for policy in ("fcfs", "sjf"):
                    runs = [summarize_run(*rep[policy]) for rep in reps]
                    entry[policy] = summarize_run([r for rep in reps for r in rep[policy][0]],
                                                  sum(rep[policy][1] for rep in reps))
                    entry[policy]["rep_e2e_means"] = [r["e2e_mean"] for r in runs]
                entry["rep_ratios"] = [f / s for f, s in zip(entry["fcfs"]["rep_e2e_means"],
                                                             entry["sjf"]["rep_e2e_means"])]
                print(f"[bench serve] bd load {load:g} ({rate:.1f} req/s): mean e2e fcfs "
                      f"{entry['fcfs']['e2e_mean']:.3f} s, sjf {entry['sjf']['e2e_mean']:.3f} s, per run "
                      f"FCFS/SJF {', '.join(f'{x:.2f}' for x in entry['rep_ratios'])}, errors "
                      f"{entry['fcfs']['errors'] + entry['sjf']['errors']}", flush=True)
        for load, entry in loads.items():
            arrivals = entry.pop("arrivals")
            sim = {name: simulate(arrivals, service, first, {"dws_cost": predicted}, pol)
                   for name, pol in (("fcfs", FCFS()), ("sjf", SJF(key="dws_cost", aging=aging)))}
            entry["simulated"] = {name: summarize(r.latency) for name, r in sim.items()}
            entry["ratio_fcfs_over_sjf_measured"] = entry["fcfs"]["e2e_mean"] / entry["sjf"]["e2e_mean"]
            entry["ratio_fcfs_over_sjf_simulated"] = sim["fcfs"].latency.mean() / sim["sjf"].latency.mean()
        result["dws"] = {"predictor": predictor_dir, "cost_model_from": dws_report, "aging": aging,
                         "calibration": calibration, "loads": loads}
    result["wall_s"] = time.perf_counter() - t_start
    workflows.write_json(out, result)
    summary = {k: v for k, v in result.items() if k.endswith(("_over_ar_tokens_per_s", "_over_ar_requests_per_s"))}
    if "engines" in parts:
        summary["overhead_share_batch1"] = result["overhead_share_batch1"]
        summary["server_overhead_share_batch1"] = result["server_overhead_share_batch1"]
        if "lean_route_batch1" in result:
            summary["lean_route_batch1"] = {k: v for k, v in result["lean_route_batch1"].items()
                                            if k.endswith(("_over_lean_server_ms", "_over_lean_e2e"))
                                            or k == "median_server_overhead_share"}
    if "dws" in parts:
        summary["dws"] = {k: {"measured": v["ratio_fcfs_over_sjf_measured"],
                              "simulated": v["ratio_fcfs_over_sjf_simulated"]} for k, v in result["dws"]["loads"].items()}
    print(json.dumps(summary, indent=2))
    return result
