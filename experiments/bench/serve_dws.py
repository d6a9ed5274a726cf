"""`relf-jax bench serve`'s part 3: FCFS vs SJF-DWS on the block-diffusion engine with one slot,
both policies in one server process, every request sent to both at once (a paired comparison),
next to the discrete-event simulator's prediction from the batch-1 times."""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from experiments.bench.dws import bench_dws
from experiments.bench.serve_client import chat_bodies, run_load, summarize_run
from experiments.bench.serve_servers import ServerProcess, batch1_run
from relf_jax.dws.predictor import WorkloadCost
from relf_jax.loading import load_model
from relf_jax.methods import BlockDiffusion
from relf_jax.serving.http import serve
from relf_jax.serving.loading import build_models
from relf_jax.serving.scheduler import FCFS, SJF, aging_for
from relf_jax.serving.simulator import poisson_arrivals, simulate, summarize

POLICIES = ("fcfs", "sjf")


def ensure_dws(workdir: str, quick: bool) -> tuple[str, str]:
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
        print(f"[bench serve] no DWS predictor in {dws_dir}: running bench dws (writes {report})", flush=True)
        bench_dws(report, quick=quick, workdir=dws_dir)
    return headline(), report


def policies_server_child(spec: dict) -> None:
    """A server with one block-diffusion engine per policy, as model ids "fcfs" and "sjf" (SJF on
    the DWS predicted cost, with `spec["aging"]`): what `relf-jax serve --policy ...` builds, twice."""
    cost = WorkloadCost(load_model(spec["predictor"], "dws"), spec["cost_model"])
    models = {}
    for policy in ("fcfs", "sjf"):
        models.update(build_models(spec["workdir"], [BlockDiffusion()], model_name=policy, slots=1,
                                   max_queue=spec["max_queue"], policy=policy, aging=spec["aging"],
                                   cost_fn=cost if policy == "sjf" else None))
    serve(models, host="127.0.0.1", port=spec["port"], log_level="warning")


def dws_part(workdir: str, quick: bool, sz, prompts, logs: str) -> dict:
    """Part 3 on the first `sz.dws_requests` prompts: the report's "dws_batch1" and "dws" entries."""
    predictor_dir, dws_report = ensure_dws(workdir, quick)
    bd_dir = os.path.join(workdir, "dws")
    cost = WorkloadCost(load_model(predictor_dir, "dws"), dws_report)
    bd_tok = load_model(bd_dir, "bd").tokenizer
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
    print("[bench serve] bd engine, fcfs + sjf: starting the server", flush=True)
    with ServerProcess([], os.path.join(logs, "serve_bd.log"), child_spec=spec) as srv:
        url = f"{srv.base}/v1/chat/completions"
        # every prompt alone: the service times the simulator replays
        cal = batch1_run(srv, chat_bodies(dws_prompts, "fcfs", max_tokens=sz.dws_max_tokens, temperature=0.0,
                                          seed=sz.seed))
        service = np.asarray([r["e2e"] for r in cal["records"]])
        first = np.asarray([min(r["ttft"] or r["e2e"], r["e2e"]) for r in cal["records"]])
        result = {"dws_batch1": {k: v for k, v in cal.items() if k != "records"}}
        calibration = _capacity(url, dws_prompts, sz, service)
        scale = calibration["service_scale"]
        service, first = service * scale, first * scale
        loads = {f"{load:g}": _paired_load(url, dws_prompts, sz, load, calibration["capacity_rps"])
                 for load in sz.dws_loads}
    for entry in loads.values():
        arrivals = entry.pop("arrivals")
        sim = {name: simulate(arrivals, service, first, {"dws_cost": predicted}, pol)
               for name, pol in (("fcfs", FCFS()), ("sjf", SJF(key="dws_cost", aging=aging)))}
        entry["simulated"] = {name: summarize(r.latency) for name, r in sim.items()}
        entry["ratio_fcfs_over_sjf_measured"] = entry["fcfs"]["e2e_mean"] / entry["sjf"]["e2e_mean"]
        entry["ratio_fcfs_over_sjf_simulated"] = sim["fcfs"].latency.mean() / sim["sjf"].latency.mean()
    result["dws"] = {"predictor": predictor_dir, "cost_model_from": dws_report, "aging": aging,
                     "calibration": calibration, "loads": loads}
    return result


def _both(url: str, prompts, sz, arrivals) -> dict:
    """One load on both policies at once; returns {policy: (records, wall)}. Which of a pair is
    sent first alternates."""
    bodies = {p: chat_bodies(prompts, p, max_tokens=sz.dws_max_tokens, temperature=0.0, seed=sz.seed)
              for p in POLICIES}
    order = [(("fcfs", "sjf") if i % 2 == 0 else ("sjf", "fcfs")) for i in range(len(prompts))]
    flat = [(p, i) for i, pair in enumerate(order) for p in pair]
    res = run_load(url, [bodies[p][i] for p, i in flat], [float(arrivals[i]) for _, i in flat])
    out = {}
    for p in POLICIES:
        recs = [r for (q, _), r in zip(flat, res["records"]) if q == p]
        out[p] = (recs, max(r["arrival"] + (r["e2e"] or 0.0) for r in recs))
    return out


def _capacity(url: str, prompts, sz, service: np.ndarray) -> dict:
    """Each policy's capacity while both run, from a run that overloads both: the batch-1 rate,
    where each gets about half the machine (a burst of every request at once instead measures the
    HTTP front end, not the steady state). A batch-1 time holds client, HTTP and loopback time
    that overlaps model steps under load, and the two engines share the CPU, so loads are
    fractions of this capacity and the simulator replays the batch-1 times scaled to it
    (``service_scale``: the same load on both sides)."""
    batch1_rps = 1.0 / float(np.mean(service))
    over = _both(url, prompts, sz, poisson_arrivals(batch1_rps, len(prompts), sz.seed + 5))
    capacity = len(prompts) / max(wall for _, wall in over.values())
    scale = 1.0 / (capacity * float(np.mean(service)))
    print(f"[bench serve] bd capacity {capacity:.1f} req/s per policy with both running "
          f"(batch-1 times x {scale:.2f})", flush=True)
    return {"capacity_rps": capacity, "service_scale": scale, "batch1_rps": batch1_rps,
            "overload_run": {p: summarize_run(recs, wall) for p, (recs, wall) in over.items()}}


def _paired_load(url: str, prompts, sz, load: float, capacity: float) -> dict:
    """`sz.dws_reps` paired runs at `load` x `capacity`: each policy's summary over all runs, the
    per-run mean latencies and FCFS / SJF ratios (and the arrivals, for the simulator)."""
    rate = load * capacity
    arrivals = poisson_arrivals(rate, len(prompts), sz.seed + 11)
    entry = {"rate_rps": rate, "arrivals": arrivals}
    reps = [_both(url, prompts, sz, arrivals) for _ in range(sz.dws_reps)]
    for policy in POLICIES:
        runs = [summarize_run(*rep[policy]) for rep in reps]
        entry[policy] = summarize_run([r for rep in reps for r in rep[policy][0]],
                                      sum(rep[policy][1] for rep in reps))
        entry[policy]["rep_e2e_means"] = [r["e2e_mean"] for r in runs]
    entry["rep_ratios"] = [f / s for f, s in zip(entry["fcfs"]["rep_e2e_means"], entry["sjf"]["rep_e2e_means"])]
    print(f"[bench serve] bd load {load:g} ({rate:.1f} req/s): mean e2e fcfs "
          f"{entry['fcfs']['e2e_mean']:.3f} s, sjf {entry['sjf']['e2e_mean']:.3f} s, per run "
          f"FCFS/SJF {', '.join(f'{x:.2f}' for x in entry['rep_ratios'])}, errors "
          f"{entry['fcfs']['errors'] + entry['sjf']['errors']}", flush=True)
    return entry
