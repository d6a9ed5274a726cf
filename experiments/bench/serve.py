"""`relf-jax bench serve`: the live server under a Poisson load, measured from the client.

Composition only. It starts `relf-jax serve` subprocesses on 127.0.0.1 and drives each with a
load generator in its own process (`load_child`: asyncio + httpx, open-loop Poisson arrivals,
a fixed number of streaming chat requests built from `synthetic_chat` and `chatterbot`
prompts). Every request records its time to first token (TTFT), time per output token after
the first (TPOT), end-to-end latency and its output tokens (the server's usage report);
a run reports p50/p99 of each, the mean latency, output tokens/s over the run, and errors.

Four comparisons, each side by side in one run (parts "engines": 1 and 2, "batcher": the
second half of 1, "dws": 3, "multiturn": 4):

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
4. **Multi-turn conversations with and without the prefix cache** (`serve_multiturn`): 8-turn
   conversations from the chat corpus against two AR servers of the same model, one with
   ``--prefix-cache-mb``; the median TTFT of each turn at batch 1 and at a saturating rate, output
   tokens/s, whether the replies are token-identical, and the cache's hits and memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

import numpy as np

import relf_jax as rj
from experiments.bench.common import draft_steps, reply_quality
from experiments.bench.serve_batcher import batcher_part
from experiments.bench.serve_client import chat_bodies, run_load, summarize_run
from experiments.bench.serve_dws import dws_part
from experiments.bench.serve_multiturn import QUICK_MULTITURN, MultiturnSizes, multiturn_part, plot_ttft, ttft_table
from experiments.bench.serve_servers import ServerProcess, batch1_run, lean_route_batch1
from relf_jax.config import make_config
from relf_jax.dws.workload import workload_prompts
from relf_jax.errors import UserError
from relf_jax.eval.evaluate import exact_judge
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.serving.simulator import poisson_arrivals
from relf_jax.speculative.recipes import train_draft


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
    multiturn: MultiturnSizes = MultiturnSizes()


# the engines compared on one request stream: name -> `relf-jax serve` arguments
SPEC_ENGINES = (("ar", ["--generator", "ar"]),
                ("nsd", ["--generator", "nsd", "--proposer", "draft"]),
                ("nsd_lookup", ["--generator", "nsd", "--proposer", "prompt_lookup"]),
                ("nsd_ngram", ["--generator", "nsd", "--proposer", "corpus_ngram"]))

QUICK = ServeBenchSizes(preset="tiny", requests=48, rate_factors=(1.0, 8.0), batch1_requests=8, lean_route_reps=1,
                        batcher_reps=1,
                        dws_requests=48,
                        dws_loads=(1.2,), dws_reps=1, max_tokens=32, dws_max_tokens=48,
                        multiturn=QUICK_MULTITURN)


PARTS = ("engines", "batcher", "dws", "multiturn")


def bench_serve(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
                sizes: ServeBenchSizes | None = None, parts: Sequence[str] = PARTS) -> dict:
    """Runs the comparisons named in `parts` ("engines": 1 + 2 of the module docstring; "batcher":
    the same engines' capacity without the server, `batcher_capacity`; "dws": 3; "multiturn": 4,
    with its TTFT-per-turn plot next to `out`) and writes the JSON to `out`."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise UserError(f"bench serve parts must be a non-empty subset of {', '.join(PARTS)}; got {list(parts)}")
    sz = sizes or (QUICK if quick else ServeBenchSizes())
    workdir = workdir or os.path.join("runs", f"bench_serve_{sz.preset}")
    os.makedirs(workdir, exist_ok=True)
    t_start = time.perf_counter()
    # the distilled draft serves the NSD engines of parts engines and batcher only
    cfg = ensure_models(workdir, sz.preset, overrides, draft=bool({"engines", "batcher"} & set(parts)))
    judge = exact_judge(cfg)
    tok = load_model(workdir, "ar").tokenizer
    n_all = max(sz.requests, sz.batch1_requests, sz.dws_requests)
    prompts = workload_prompts(tok, n_synthetic=int(n_all * 0.8) + 1, n_chatterbot=n_all // 5 + 1,
                               seed=sz.seed + 1234)
    rng = np.random.default_rng(sz.seed)
    prompts = [prompts[i] for i in rng.permutation(len(prompts))]
    result: dict = {"config": {**dataclasses.asdict(sz), "workdir": os.path.abspath(workdir), "parts": list(parts)}}
    logs = os.path.join(workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    if "engines" in parts:  # 1 + 2: AR vs NSD, and batch-1 overhead
        result.update(engines_part(workdir, sz, prompts, judge, logs))
    if "batcher" in parts:  # the same engines without the server: their capacity in this process
        result.update(batcher_part(workdir, sz, prompts, SPEC_ENGINES))
    if "dws" in parts:  # 3: FCFS vs SJF-DWS on the block-diffusion engine, one slot
        result.update(dws_part(workdir, quick, sz, prompts, logs))
    if "multiturn" in parts:  # 4: multi-turn conversations with and without the prefix cache
        result["multiturn"] = multiturn_part(["--workdir", workdir], sz.multiturn, sz.slots, tok, logs, sz.seed)
        plot_ttft(result["multiturn"], os.path.splitext(out)[0] + "_multiturn_ttft.png")
        print(ttft_table(result["multiturn"]), flush=True)
    result["wall_s"] = time.perf_counter() - t_start
    write_json(out, result)
    print(json.dumps(summary(result, parts), indent=2))
    return result


def summary(result: dict, parts: Sequence[str]) -> dict:
    """The headline ratios of a `bench_serve` report."""
    out = {k: v for k, v in result.items() if k.endswith(("_over_ar_tokens_per_s", "_over_ar_requests_per_s"))}
    if "engines" in parts:
        out["overhead_share_batch1"] = result["overhead_share_batch1"]
        out["server_overhead_share_batch1"] = result["server_overhead_share_batch1"]
        if "lean_route_batch1" in result:
            out["lean_route_batch1"] = {k: v for k, v in result["lean_route_batch1"].items()
                                        if k.endswith(("_over_lean_server_ms", "_over_lean_e2e"))
                                        or k == "median_server_overhead_share"}
    if "multiturn" in parts:
        mt = result["multiturn"]
        out["multiturn"] = {k: mt[k] for k in ("turn8_ttft_ratio_off_over_on", "tokens_per_s_ratio_on_over_off",
                                               "identical_replies", "memory_within_budget")}
    if "dws" in parts:
        out["dws"] = {k: {"measured": v["ratio_fcfs_over_sjf_measured"],
                          "simulated": v["ratio_fcfs_over_sjf_simulated"]} for k, v in result["dws"]["loads"].items()}
    return out


def ensure_models(workdir: str, preset: str, overrides: Sequence[str], draft: bool = True):
    """The target and (draft=True) its distilled draft in `workdir` (trained, resumed or reused); the config."""
    cfg = make_config(preset, list(overrides), workdir=workdir)
    rj.train(cfg)
    if draft:
        train_draft(cfg.workdir, [f"train.steps={draft_steps(cfg)}"])
    return cfg


def served_reply_quality(judge, prompts: Sequence[str], records: list[dict]) -> dict:
    """`reply_quality` of the replies a load run got without an error (scored as prefixes)."""
    ok = [(p, r["text"]) for p, r in zip(prompts, records) if r["error"] is None]
    return reply_quality(judge, [p for p, _ in ok], [t for _, t in ok])


def engines_part(workdir: str, sz: ServeBenchSizes, prompts, judge, logs: str) -> dict:
    """Each of `SPEC_ENGINES` behind its own server: batch-1 overhead, then the same request
    stream at each of `sz.rate_factors` x the AR engine's batch-1 rate (and, on the AR server,
    `lean_route_batch1`); the report's entries for part 1 + 2."""
    common = ["--workdir", workdir, "--slots", str(sz.slots), "--k", str(sz.k), "--model-name", "m"]
    if sz.max_context is not None:
        common += ["--max-context", str(sz.max_context)]
    result, engines, base_rate = {}, {}, None
    batch1_bodies = chat_bodies(prompts[:sz.batch1_requests], "m", max_tokens=sz.max_tokens,
                                temperature=sz.temperature, seed=sz.seed)
    for gen, extra in SPEC_ENGINES:
        print(f"[bench serve] {gen} engine: starting the server", flush=True)
        with ServerProcess([*common, *extra], os.path.join(logs, f"serve_{gen}.log")) as srv:
            b1 = batch1_run(srv, batch1_bodies)
            if gen == "ar":
                base_rate = b1["requests"] / b1["wall_s"]
                if sz.lean_route_reps > 0:  # before the loaded runs: every server compared is fresh
                    result["lean_route_batch1"] = lean_route_batch1(
                        srv, b1, {"stack": ([*common, *extra, "--no-lean-routes"],
                                            os.path.join(logs, "serve_ar_stack.log")),
                                  "no_overlap": ([*common, *extra, "--overlap", "off"],
                                                 os.path.join(logs, "serve_ar_no_overlap.log"))},
                        batch1_bodies, sz.lean_route_reps)
            runs = _rate_runs(srv, gen, sz, prompts, judge, base_rate)
            engines[gen] = {"batch1": {k: v for k, v in b1.items() if k != "records"}, "rates": runs,
                            "acceptance_length": srv.metric("relf_acceptance_length")}
    result["engines"] = engines
    ar_rates = engines["ar"]["rates"]
    for gen in engines:
        if gen != "ar":
            result[f"{gen}_over_ar_tokens_per_s"] = {
                f: engines[gen]["rates"][f]["output_tokens_per_s"] / ar_rates[f]["output_tokens_per_s"]
                for f in ar_rates}
    result["overhead_share_batch1"] = {g: engines[g]["batch1"]["overhead_share"] for g in engines}
    result["server_overhead_share_batch1"] = {g: engines[g]["batch1"]["server_overhead_share"] for g in engines}
    return result


def _rate_runs(srv: ServerProcess, gen: str, sz: ServeBenchSizes, prompts, judge, base_rate: float) -> dict:
    """The request stream at each rate factor on one server: summary and reply quality per rate."""
    runs = {}
    bodies = chat_bodies(prompts[:sz.requests], "m", max_tokens=sz.max_tokens, temperature=sz.temperature,
                         seed=sz.seed)
    for f in sz.rate_factors:
        rate = f * base_rate
        arrivals = poisson_arrivals(rate, sz.requests, sz.seed + 7)
        res = run_load(f"{srv.base}/v1/chat/completions", bodies, arrivals)
        run = {"rate_rps": rate, **summarize_run(res["records"], res["wall_s"]),
               "quality": served_reply_quality(judge, [p.text for p in prompts[:sz.requests]], res["records"])}
        runs[f"{f:g}"] = run
        print(f"[bench serve] {gen} x{f:g} ({rate:.2f} req/s): {run['output_tokens_per_s']:.0f} tok/s, "
              f"mean e2e {run['e2e_mean']:.2f} s, errors {run['errors']}", flush=True)
    return runs
