"""`relf-jax bench serve`'s client: chat request bodies, the load generator (its own process:
asyncio + httpx, open-loop arrivals or one request after another) and a run's summary."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench.common import REPO_ROOT


def chat_bodies(prompts, model: str, *, max_tokens: int, temperature: float, seed: int) -> list[dict]:
    """Streaming chat request bodies, one per prompt (its text without the turn markers), seeds from `seed`."""
    out = []
    for i, p in enumerate(prompts):
        content = p.text.replace("<user>", " ").replace("<assistant>", " ").strip()
        out.append({"model": model, "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                    "temperature": temperature, "seed": seed + i})
    return out


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


async def one_request(client, url: str, body: dict, at: float, t0: float) -> dict:
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
                    recs.append(await one_request(client, spec["url"], body, 0.0, time.perf_counter()))
            else:
                recs = await asyncio.gather(*(one_request(client, spec["url"], b, a, t0)
                                              for b, a in zip(spec["bodies"], spec["arrivals"])))
            return list(recs), time.perf_counter() - t0

    records, wall = asyncio.run(main())
    return {"records": records, "wall_s": wall}


def run_load(url: str, bodies: list[dict], arrivals: Sequence[float] | None) -> dict:
    """The load generator in its own process; returns its records and wall time."""
    spec = {"url": url, "bodies": bodies, "arrivals": None if arrivals is None else [float(a) for a in arrivals]}
    code = ("import json, sys; from experiments.bench.serve_client import load_child; "
            "print(json.dumps(load_child(json.loads(sys.stdin.read()))))")
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])
