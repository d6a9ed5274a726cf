"""`relf-jax bench serve`'s in-process part: the engines behind their `Batcher`s with no server
and no client, every request queued at once: the ceiling of the ratios measured through HTTP."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench.serve_client import chat_bodies
from relf_jax.methods import parse_method
from relf_jax.serving.batching import GenerationRequest
from relf_jax.serving.chat_template import encode_chat
from relf_jax.serving.engine_api import RequestParams
from relf_jax.serving.loading import build_models


def engine_kw(args: Sequence[str]) -> tuple[str, dict]:
    """(generator, `relf_jax.methods.parse_method` keywords) of a `SPEC_ENGINES` argument list."""
    opts = dict(zip(args[::2], args[1::2]))
    return opts.pop("--generator"), {k.lstrip("-").replace("-", "_"): v for k, v in opts.items()}


def _drain(batcher, requests: list) -> dict:
    """Queue every request in `requests` (prompt ids, `RequestParams`) at once on a started
    `Batcher`; wait for all of them: output tokens/s and requests/s over that time."""
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


def batcher_part(workdir: str, sz, prompts, engines) -> dict:
    """The `engines` (name, `relf-jax serve` arguments) without the server: each behind its
    `Batcher` in this process, `batcher_capacity` on the bench's requests; the report's "batcher"
    entry and each engine's tokens/s and requests/s over AR's."""
    served = {}
    try:
        for gen, extra in engines:
            generator, kw = engine_kw(extra)
            method = parse_method(generator, k=sz.k, **kw)  # as `relf-jax serve` parses the same arguments
            print(f"[bench serve] {gen} engine in process: compiling", flush=True)
            with contextlib.redirect_stderr(sys.stdout):
                served[gen] = build_models(workdir, [method], model_name="m", slots=sz.slots,
                                           max_context=sz.max_context)["m"][0]
        one = served["ar"]  # every engine shares the model's tokenizer and template
        bodies = chat_bodies(prompts[:sz.requests], "m", max_tokens=sz.max_tokens, temperature=sz.temperature,
                             seed=sz.seed)
        requests = [(encode_chat(one.engine.tokenizer, one.template, b["messages"]),  # what the server makes of it
                     RequestParams(max_tokens=b["max_tokens"], temperature=b["temperature"],
                                   seed=b["seed"] % (2 ** 31))) for b in bodies]
        cap = batcher_capacity({gen: s.batcher for gen, s in served.items()}, requests, sz.batcher_reps)
    finally:
        for s in served.values():
            s.batcher.stop()
    for gen, r in cap.items():
        print(f"[bench serve] {gen} in process: {r['output_tokens_per_s']:.0f} tok/s, "
              f"{r['requests_per_s']:.1f} req/s, {r['tokens_per_request']:.1f} tokens/request", flush=True)
    result = {"batcher": cap}
    for gen in cap:
        if gen != "ar":
            result[f"batcher_{gen}_over_ar_tokens_per_s"] = (cap[gen]["output_tokens_per_s"]
                                                             / cap["ar"]["output_tokens_per_s"])
            result[f"batcher_{gen}_over_ar_requests_per_s"] = (cap[gen]["requests_per_s"]
                                                               / cap["ar"]["requests_per_s"])
    return result
