"""`relf-jax bench serve --parts multiturn`: multi-turn conversations against two servers of the
same model, one with the prefix cache (`relf-jax serve --prefix-cache-mb`) and one without.

A conversation has `turns` user turns, drawn from the built-in `synthetic_chat` corpus's user
turns; each turn sends the whole conversation so far (the user's turns and the model's replies
as it gave them) and the next turn is sent when the reply ends. Conversations start at Poisson
times at a given rate (conversations per second). Per turn the client records its time to first
token (TTFT: request sent to the first content byte of the stream) and the reply; a run reports
the median TTFT of each turn, output tokens/s over the run, and the replies.

Two loads, each run on both servers in one bench run (one server at a time, so they never share
the CPU): **batch 1** (one conversation at a time; the conversations alternate between the
servers) and a **saturating** rate (`saturating_factor` x the batch-1 request rate, as
conversation starts; the off server runs first, then the on server, `reps` times in mirrored
order). Every request carries its own seed, so with an exact cache the replies of the two servers
are token-identical (`identical_replies`). The on server's `/metrics` gives the cache's hits,
hit tokens, evictions and bytes in use against its budget.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from experiments.bench.common import REPO_ROOT
from experiments.bench.serve_servers import ServerProcess


@dataclasses.dataclass(frozen=True)
class MultiturnSizes:
    conversations: int = 16  # per load
    turns: int = 8
    max_tokens: int = 14  # per reply
    max_user_tokens: int = 10  # a user turn's tokens at most (8 turns fit the `cpu` preset's 256-token context)
    saturating_factor: float = 16.0  # x the batch-1 request rate, as conversation starts
    reps: int = 2  # saturating runs per server, in mirrored order
    prefix_cache_mb: float = 64.0
    temperature: float = 1.0
    steps_per_call: int | None = None  # the servers' --steps-per-call (None: their default)


QUICK_MULTITURN = MultiturnSizes(conversations=6, turns=8, max_tokens=6, max_user_tokens=5, reps=1,
                                 prefix_cache_mb=8.0)


def user_turns(tok, n: int, max_tokens: int, seed: int) -> list[str]:
    """`n` user turns of at most `max_tokens` tokens, from `synthetic_chat` dialogues (every
    user turn of each, in order)."""
    from relf_jax.data.synthetic_chat import SyntheticChat

    grammar, out, batch = SyntheticChat(), [], 0
    while len(out) < n:
        for info in grammar.sample_with_info(max(64, n), seed + batch):
            for part in info["text"].split("<user>")[1:]:
                text = part.split("<assistant>")[0].strip()
                if text and len(tok.encode(text)) <= max_tokens:
                    out.append(text)
        batch += 1
    return out[:n]


def conversations(tok, sz: MultiturnSizes, seed: int) -> list[list[str]]:
    turns = user_turns(tok, sz.conversations * sz.turns, sz.max_user_tokens, seed)
    return [turns[c * sz.turns:(c + 1) * sz.turns] for c in range(sz.conversations)]


async def _conversation(client, url: str, model: str, turns: Sequence[str], start: float, t0: float, sz: dict,
                        seed: int) -> list[dict]:
    import asyncio
    import time

    from experiments.bench.serve_client import one_request

    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    messages, out = [], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text})
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "messages": list(messages),
                "max_tokens": sz["max_tokens"], "temperature": sz["temperature"], "seed": seed * 1000 + i}
        rec = await one_request(client, url, body, 0.0, time.perf_counter())
        out.append(rec)
        if rec["error"] is not None:
            break
        messages.append({"role": "assistant", "content": rec["text"]})
    return out


def multiturn_child(spec: dict) -> dict:
    """Run conversations: spec = {model, sizes, jobs: [{url, turns: [user turn], seed, start}],
    concurrent}. concurrent: every job starts at its `start` (s after the run's start); else the
    jobs run one after another (batch 1). One HTTP client (its connections reused) for all.
    Returns per job its turns' records, and the run's wall time."""
    import asyncio
    import time

    import httpx

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=512)) as c:
            t0 = time.perf_counter()
            if not spec["concurrent"]:
                recs = [await _conversation(c, j["url"], spec["model"], j["turns"], 0.0, time.perf_counter(),
                                            spec["sizes"], j["seed"]) for j in spec["jobs"]]
            else:
                recs = await asyncio.gather(*(_conversation(c, j["url"], spec["model"], j["turns"], j["start"], t0,
                                                            spec["sizes"], j["seed"]) for j in spec["jobs"]))
            return list(recs), time.perf_counter() - t0

    records, wall = asyncio.run(main())
    return {"records": records, "wall_s": wall}


def run_conversations(jobs: list[dict], sz: MultiturnSizes, concurrent: bool) -> dict:
    """`multiturn_child` in its own process (the client never shares the server's interpreter)."""
    spec = {"model": "m", "jobs": jobs, "concurrent": concurrent,
            "sizes": {"max_tokens": sz.max_tokens, "temperature": sz.temperature}}
    code = ("import json, sys; from experiments.bench.serve_multiturn import multiturn_child; "
            "print(json.dumps(multiturn_child(json.loads(sys.stdin.read()))))")
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                         cwd=REPO_ROOT, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _by_turn(runs: list[dict], turns: int) -> list[float | None]:
    """Median TTFT (ms) of each turn over the conversations of `runs`."""
    out = []
    for t in range(turns):
        xs = [conv[t]["ttft"] * 1e3 for run in runs for conv in run["records"]
              if len(conv) > t and conv[t]["error"] is None and conv[t]["ttft"] is not None]
        out.append(float(np.median(xs)) if xs else None)
    return out


def _replies(runs: list[dict]) -> list:
    return [[(r["text"], r["error"]) for r in conv] for run in runs for conv in run["records"]]


def _differing(a: list[dict], b: list[dict]) -> dict:
    """How many of the replies of runs `a` and `b` (the same conversations) differ, and where the
    first does (conversation, turn)."""
    ra, rb = _replies(a), _replies(b)
    pairs = [(c, t) for c, (x, y) in enumerate(zip(ra, rb)) for t in range(max(len(x), len(y)))
             if t >= len(x) or t >= len(y) or x[t] != y[t]]
    return {"replies": sum(len(x) for x in ra), "differing": len(pairs),
            "conversations_diverged": len({c for c, _ in pairs}), "first": pairs[0] if pairs else None}


def _tokens_per_s(run: dict) -> float:
    return sum(r["tokens"] for conv in run["records"] for r in conv if r["error"] is None) / max(run["wall_s"], 1e-9)


def _errors(runs: list[dict]) -> int:
    return sum(r["error"] is not None for run in runs for conv in run["records"] for r in conv)


def multiturn_part(model_args: list[str], sz: MultiturnSizes, slots: int, tok, logs: str, seed: int = 0) -> dict:
    """Both loads on the servers with and without the prefix cache; the report's ``multiturn``
    entry. model_args: the model's `relf-jax serve` arguments (``--workdir DIR``)."""
    from relf_jax.serving.simulator import poisson_arrivals

    convs = conversations(tok, sz, seed + 4321)
    seeds = list(range(len(convs)))
    common = [*model_args, "--slots", str(slots), "--model-name", "m"]
    if sz.steps_per_call is not None:
        common += ["--steps-per-call", str(sz.steps_per_call)]
    with ServerProcess([*common, "--prefix-cache-mb", str(sz.prefix_cache_mb)],
                       os.path.join(logs, "serve_multiturn_on.log"), wait=False) as on, \
            ServerProcess(common, os.path.join(logs, "serve_multiturn_off.log"), wait=False) as off:
        servers = {"off": off.wait_ready(), "on": on.wait_ready()}  # both start at once
        url = {name: f"{srv.base}/v1/chat/completions" for name, srv in servers.items()}
        # warm both (connections, first requests) on a conversation that is not measured
        run_conversations([{"url": url[n], "turns": convs[0], "seed": 10_000, "start": 0.0} for n in servers], sz,
                          concurrent=False)
        hits0 = on.metric("relf_prefix_cache_hit_tokens_total")
        # batch 1: one conversation at a time, each on both servers in turn (alternating which first)
        order = [(c, name) for c in range(len(convs)) for name in (("off", "on") if c % 2 == 0 else ("on", "off"))]
        run = run_conversations([{"url": url[name], "turns": convs[c], "seed": seeds[c], "start": 0.0}
                                 for c, name in order], sz, concurrent=False)
        batch1: dict[str, list[dict]] = {"off": [None] * len(convs), "on": [None] * len(convs)}
        for (c, name), recs in zip(order, run["records"]):
            batch1[name][c] = recs
        b1_s = sum(r["e2e"] for conv in batch1["off"] for r in conv)
        b1_rate = len(convs) * sz.turns / max(b1_s, 1e-9)  # requests/s without the cache, one at a time
        conv_rate = sz.saturating_factor * b1_rate / sz.turns
        starts = poisson_arrivals(conv_rate, len(convs), seed + 99)
        loaded: dict[str, list[dict]] = {"off": [], "on": []}
        for i in range(sz.reps):
            for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                loaded[name].append(run_conversations(
                    [{"url": url[name], "turns": conv, "seed": seed_, "start": float(t)}
                     for conv, seed_, t in zip(convs, seeds, starts)], sz, concurrent=True))
        cache = {k: on.metric(f"relf_prefix_cache_{k}") for k in
                 ("hits_total", "lookups_total", "hit_tokens_total", "evictions_total", "bytes_in_use",
                  "bytes_budget")}
        cache["hit_tokens_measured_runs"] = cache["hit_tokens_total"] - hits0
    batch1 = {k: [{"records": v, "wall_s": None}] for k, v in batch1.items()}  # one run of all the conversations
    ttft = {"batch1": {k: _by_turn(v, sz.turns) for k, v in batch1.items()},
            "saturating": {k: _by_turn(v, sz.turns) for k, v in loaded.items()}}
    last = sz.turns - 1
    tps = {k: [_tokens_per_s(r) for r in v] for k, v in loaded.items()}
    diffs = {"batch1": _differing(batch1["off"], batch1["on"]),
             "saturating": _differing(loaded["off"][:1], loaded["on"][:1])}
    # the control: the same server, the same stream, run twice at the saturating rate. A slot's
    # tokens do not depend on the others', but the batch a step runs (which slots, how many) is set
    # by timing, and steps over other slot counts are other programs whose float sums may round
    # differently: a reply whose sampled token sat on a boundary can flip with no cache at all
    control = _differing(loaded["off"][:1], loaded["off"][1:2]) if len(loaded["off"]) > 1 else None
    out = {
        "ttft_ms_by_turn": ttft,
        "turn8_ttft_ratio_off_over_on": {
            load: (t["off"][last] / t["on"][last] if t["off"][last] and t["on"][last] else None)
            for load, t in ttft.items()},
        "tokens_per_s": tps,
        "tokens_per_s_ratio_on_over_off": float(np.median(tps["on"]) / np.median(tps["off"])),
        # batch 1 runs every conversation alone on both servers: the same programs, so any
        # difference there is the cache's
        "identical_replies": diffs["batch1"]["differing"] == 0,
        "differing_replies": diffs, "differing_replies_off_vs_off_saturating": control,
        "errors": {"batch1": {k: _errors(v) for k, v in batch1.items()},
                   "saturating": {k: _errors(v) for k, v in loaded.items()}},
        "batch1_requests_per_s": b1_rate, "saturating_conversations_per_s": conv_rate,
        "prefix_cache": cache,
        "memory_within_budget": cache["bytes_in_use"] <= cache["bytes_budget"],
        "sizes": dataclasses.asdict(sz),
    }
    return out


def ttft_table(mt: dict) -> str:
    """A markdown table of the median TTFT per turn, both loads, cache off / on."""
    loads = list(mt["ttft_ms_by_turn"])
    head = "| turn | " + " | ".join(f"{load} off (ms) | {load} on (ms) | off / on" for load in loads) + " |"
    rows = [head, "|" + "---|" * (1 + 3 * len(loads))]
    turns = len(mt["ttft_ms_by_turn"][loads[0]]["off"])
    for t in range(turns):
        cells = []
        for load in loads:
            a, b = mt["ttft_ms_by_turn"][load]["off"][t], mt["ttft_ms_by_turn"][load]["on"][t]
            cells += [f"{a:.1f}" if a else "-", f"{b:.1f}" if b else "-", f"{a / b:.2f}" if a and b else "-"]
        rows.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot_ttft(mt: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(mt["ttft_ms_by_turn"])
    fig, axes = plt.subplots(1, len(loads), figsize=(5 * len(loads), 3.6), squeeze=False)
    for ax, load in zip(axes[0], loads):
        for name, style in (("off", "o-"), ("on", "s-")):
            ys = mt["ttft_ms_by_turn"][load][name]
            ax.plot(range(1, len(ys) + 1), [y if y is not None else np.nan for y in ys], style,
                    label=f"prefix cache {name}")
        ax.set_title(f"{load}: median TTFT per turn")
        ax.set_xlabel("turn")
        ax.set_ylabel("TTFT (ms)")
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
