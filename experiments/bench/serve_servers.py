"""`relf-jax bench serve`'s servers: `relf-jax serve` in a subprocess, and the batch-1 runs
that measure how much of a request's time is not spent in the engine."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from experiments.bench.common import REPO_ROOT
from experiments.bench.serve_client import run_load, summarize_run


class ServerProcess:
    """`relf-jax serve ARGS` on a free 127.0.0.1 port; ready once /health answers (the constructor
    waits for it unless ``wait=False``: then `wait_ready` does, so several servers start at once)."""

    def __init__(self, args: list[str], log_path: str, ready_timeout_s: float = 900.0, child_spec: dict | None = None,
                 wait: bool = True):
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
            code = ("import json, sys; from experiments.bench.serve_dws import policies_server_child; "
                    "policies_server_child(json.loads(sys.argv[1]))")
            cmd = [sys.executable, "-c", code, json.dumps({**child_spec, "port": self.port})]
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path, self.ready_timeout_s, self.started = log_path, ready_timeout_s, time.monotonic()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> ServerProcess:
        """Wait until /health answers (a RuntimeError if the server exits or does not start in time)."""
        import httpx

        log_path, ready_timeout_s = self.log_path, self.ready_timeout_s
        deadline = self.started + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}); see {log_path}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return self
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


def batch1_run(server: ServerProcess, bodies: list[dict]) -> dict:
    """Requests one after another: latency and the share of it spent outside the engine.

    overhead_share: 1 - engine seconds / client-measured e2e (everything that is not a model
    step, the HTTP client and the loopback included); server_overhead_share: (server-side
    request seconds - engine seconds) / client e2e, the server's own part of it.
    """
    m0 = server.metric("relf_model_seconds_total")
    h0 = server.metric("relf_http_request_duration_seconds_sum")
    res = run_load(f"{server.base}/v1/chat/completions", bodies, None)
    model_s = server.metric("relf_model_seconds_total") - m0
    server_s = server.metric("relf_http_request_duration_seconds_sum") - h0
    recs = res["records"]
    e2e = sum(r["e2e"] for r in recs if r["error"] is None)
    return {**summarize_run(recs, res["wall_s"]), "model_s": model_s, "client_e2e_s": e2e, "server_s": server_s,
            "overhead_share": 1.0 - model_s / max(e2e, 1e-9),
            "server_overhead_share": (server_s - model_s) / max(e2e, 1e-9), "records": recs}


def lean_route_batch1(lean: ServerProcess, first: dict, variants: dict[str, tuple[list[str], str]], bodies: list[dict],
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
            batch1_run(servers[name], bodies[:4])  # warm its connection and first requests, as `first` had
        names = list(servers)
        for i in range(reps):
            for name in names[::-1] if i % 2 == 0 else names:  # mirrored: ABC, CBA, ...
                runs[name].append(batch1_run(servers[name], bodies))
    out: dict = {}
    for name, rs in runs.items():
        ms = [(r["server_s"] - r["model_s"]) / max(r["requests"], 1) * 1e3 for r in rs]
        out[name] = {"server_ms": ms, "server_overhead_share": [r["server_overhead_share"] for r in rs],
                     "e2e_mean_ms": [r["e2e_mean"] * 1e3 for r in rs]}
    lean_ms, lean_e2e = np.median(out["lean"]["server_ms"]), np.median(out["lean"]["e2e_mean_ms"])
    for name in variants:
        out[f"{name}_over_lean_server_ms"] = float(np.median(out[name]["server_ms"]) / lean_ms)
        out[f"{name}_over_lean_e2e"] = float(np.median(out[name]["e2e_mean_ms"]) / lean_e2e)
    out["median_server_overhead_share"] = {k: float(np.median(out[k]["server_overhead_share"])) for k in runs}
    return out
