"""`bench spec`'s cost model: where a speculative round spends its time on this machine, the
speedup the standard cost model predicts from each row's measured tau next to the measured one,
and the memory regime the target decodes in (its one-token step's weight traffic against what a
lone jitted matrix-vector product streams here).

Measured in the bench's process, after its rows, on the same models; see
`relf_jax.speculative.cost` for the round profile and the formula.
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments.bench.common import find_row
from relf_jax.methods import Speculative, parse_proposer
from relf_jax.runtime.info import last_level_cache
from relf_jax.speculative.cost import (
    decode_step_ms,
    expected_speedup,
    round_profile,
    speculative_round_ms,
    weight_bytes,
)

# the matrix-vector product whose streaming rate is the bandwidth reference: 128 MiB of float32
# weights, far past any cache, laid out as the models' dense layers are ([in, out], x @ w)
MATVEC_SHAPE = (4096, 8192)


def matvec_bandwidth(shape=MATVEC_SHAPE, reps: int = 20) -> dict:
    """GB/s at which one jitted float32 ``x @ w`` ([1, in] x [in, out]) reads its weights (median of
    `reps`), and what the same product costs for 5 rows (what a K = 4 verification does to each
    weight) over 1 row: for the models' layout (``w`` [in, out]) and for the weight stored
    transposed (``w_t @ x.T``, ``w_t`` [out, in]), which XLA:CPU compiles to another kernel."""
    import jax
    import jax.numpy as jnp

    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape, np.float32))
    layouts = {"in_out": (jax.jit(lambda x, w: x @ w), w), "out_in": (jax.jit(lambda x, w: (w @ x.T).T), w.T.copy())}
    out = {"shape": list(shape)}
    for name, (f, weights) in layouts.items():
        for rows in (1, 5):
            x = jnp.ones((rows, shape[0]), jnp.float32)
            jax.block_until_ready(f(x, weights))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x, weights))
                times.append(time.perf_counter() - t0)
            out[f"{name}_{rows}_row_ms"] = 1e3 * float(np.median(times))
        out[f"{name}_5_rows_over_1"] = out[f"{name}_5_row_ms"] / out[f"{name}_1_row_ms"]
    out["gb_per_s"] = w.size * 4 / out["in_out_1_row_ms"] / 1e6
    return out


def profiles(lm, draft, table, *, k: int, batches=(1, 8), proposers=("draft", "corpus_ngram", "prompt_lookup"),
             reps: int = 5) -> dict:
    """`round_profile` of the NSD round for each proposer and batch, keyed ``"<proposer>_b<batch>"``."""
    out = {}
    for proposer in proposers:
        method = Speculative(rule="nsd", k=k, proposer=parse_proposer(proposer, draft=draft))
        inputs = {"draft": draft} if proposer == "draft" else {"table": table} if proposer == "corpus_ngram" else {}
        for batch in batches:
            out[f"{proposer}_b{batch}"] = round_profile(lm, method, batch=batch, reps=reps, **inputs)
            p = out[f"{proposer}_b{batch}"]
            print(f"[bench spec] round b={batch} {proposer:>13}: propose {p['propose_ms']:.3f} ms  target "
                  f"{p['target_forward_ms']:.3f}  verify {p['verify_ms']:.3f}  bookkeeping {p['bookkeeping_ms']:.3f}"
                  f"  round {p['round_ms']:.3f}  (one-token step {p['one_token_ms']:.3f})", flush=True)
    return out


def decode_loops(lm, draft, table, *, k: int, proposers=("draft", "corpus_ngram", "prompt_lookup"),
                 reps: int = 5, verbose: bool = True) -> dict:
    """Batch-1 decoding loops timed at three reply lengths (the prefill apart from the per-step cost):
    ``ar_b1`` (`decode_step_ms`) and ``<proposer>_b1`` (`speculative_round_ms`, the NSD rule)."""
    out = {"ar_b1": decode_step_ms(lm, reps=reps)}
    for proposer in proposers:
        method = Speculative(rule="nsd", k=k, proposer=parse_proposer(proposer, draft=draft))
        out[f"{proposer}_b1"] = speculative_round_ms(lm, method, draft=draft if proposer == "draft" else None,
                                                     table=table if proposer == "corpus_ngram" else None, reps=reps)
    if verbose:
        for name, v in out.items():
            per = v.get("step_ms", v.get("round_ms"))
            print(f"[bench spec] loop {name:>16}: {per:.3f} ms a {'step' if 'step_ms' in v else 'round'}, "
                  f"{v['fixed_ms']:.2f} ms fixed (prefill, first token, call)", flush=True)
    return out


def predictions(rows: list[dict], profs: dict, k: int, costs: dict | None = None,
                loops: dict | None = None) -> list[dict]:
    """For every speculative row at K = `k` whose proposer and batch were profiled: the measured
    speedup over AR (same batch and temperature) next to the standard model's prediction from the
    row's tau (`expected_speedup`: the drafts + the K + 1-token forward, in one-token forwards), and
    the gap named. Measured per decode step: an AR step (``ar_step_ms`` = batch / AR tokens/s) and a
    speculative round (``round_measured_ms`` = batch x tau / tokens/s), so measured speedup = tau x
    ar_step_ms / round_measured_ms exactly; against the profile, ``ar_overhead_ms`` is what an AR step
    costs beyond its forward (sampling, the loop, prefill and the host, spread over the tokens) and
    the round's own overheads are the verification rule, the bookkeeping and ``outside_round_ms``
    (the same loop, prefill and host costs of the speculative decode).

    With `costs` (`relf_jax.speculative.cost.forward_costs`: the K + 1-token over one-token forward
    ratio r per batch, the report's ``target_forward_cost``), also ``predicted_speedup_forward_cost``
    = tau / (K c + r) with that r and c the profile's drafts over its one-token forward: the two
    forwards timed in one loop back to back, where the profile's ``target_forward_ms`` and
    ``one_token_ms`` come from two loops over a state of another shape (on the EPYC they read a
    5-token forward 1.04x a one-token one at batch 1, against 1.58x in `forward_costs`).

    With `loops` (``"ar_b1"``: `relf_jax.speculative.cost.decode_step_ms`; ``"<proposer>_b1"``:
    `speculative_round_ms`) and the rows' ``mean_tokens`` (tokens per reply: n for the row, n_ar
    for its AR row; replies of the two differ in length), also ``predicted_speedup_with_prefill``:
    AR's time per token (a step + the fixed prefill and call over n_ar) over the speculative
    row's (n / tau - 1 rounds + their fixed cost, over n), every term timed in the decoding loops
    themselves. What the standard formula leaves out is then named in ms:
    ``prefill_per_token_ar_ms`` / ``prefill_per_round_ms`` (the fixed cost spread over the reply)
    and ``loop_overhead_per_round_ms`` (a loop round beyond the profile's drafts and forward)."""
    out = []
    for r in rows:
        prof = profs.get(f"{r['proposer']}_b{r['batch']}")
        if r["rule"] == "none" or r.get("k") != k or prof is None:
            continue
        ar = find_row(rows, rule="none", batch=r["batch"], temperature=r["temperature"])
        ar_step = 1e3 * r["batch"] / ar["tokens_per_s"]
        round_measured = 1e3 * r["batch"] * r["tau"] / r["tokens_per_s"]
        out.append({"method": r["method"], "proposer": r["proposer"], "batch": r["batch"],
                    "temperature": r["temperature"], "tau": r["tau"],
                    "measured_speedup": r["tokens_per_s"] / ar["tokens_per_s"],
                    "predicted_speedup": expected_speedup(r["tau"], prof["propose_ms"], prof["target_forward_ms"],
                                                          prof["one_token_ms"]),
                    "ar_step_ms": ar_step, "ar_overhead_ms": ar_step - prof["one_token_ms"],
                    "round_measured_ms": round_measured, "round_profiled_ms": prof["round_ms"],
                    "verify_ms": prof["verify_ms"], "bookkeeping_ms": prof["bookkeeping_ms"],
                    "outside_round_ms": round_measured - prof["round_ms"]})
        out[-1]["measured_over_predicted"] = out[-1]["measured_speedup"] / out[-1]["predicted_speedup"]
        fc = (costs or {}).get(f"b{r['batch']}")
        if fc is not None:
            pred = r["tau"] / (prof["propose_ms"] / prof["one_token_ms"] + fc["ratio"])
            out[-1]["predicted_speedup_forward_cost"] = pred
            out[-1]["measured_over_predicted_forward_cost"] = out[-1]["measured_speedup"] / pred
        if r["batch"] == 1 and "ar_b1" in (loops or {}) and f"{r['proposer']}_b1" in loops and r.get("mean_tokens"):
            n, n_ar = r["mean_tokens"], ar.get("mean_tokens") or r["mean_tokens"]  # the AR row's replies: n_ar
            ar_token_ms = loop_token_ms(loops, "-", 1.0, n_ar)
            sp_token_ms = loop_token_ms(loops, r["proposer"], r["tau"], n)
            sp_loop = loops[f"{r['proposer']}_b1"]
            out[-1].update({"predicted_speedup_with_prefill": ar_token_ms / sp_token_ms,
                            "measured_over_predicted_with_prefill":
                                out[-1]["measured_speedup"] * sp_token_ms / ar_token_ms,
                            "prefill_per_token_ar_ms": loops["ar_b1"]["fixed_ms"] / n_ar,
                            "prefill_per_round_ms": sp_loop["fixed_ms"] / max(n / r["tau"] - 1.0, 1.0),
                            "loop_overhead_per_round_ms": sp_loop["round_ms"] - prof["propose_ms"]
                            - prof["target_forward_ms"]})
    return out


def loop_token_ms(loops: dict, proposer: str, tau: float, tokens: float) -> float:
    """ms per token of a batch-1 reply of `tokens` tokens from the decoding loops (`decode_loops`):
    AR (`proposer` "-") a step each plus the fixed cost; speculative n / tau - 1 rounds (tau counts
    the prefill as a forward) plus the fixed cost."""
    if proposer == "-":
        return loops["ar_b1"]["step_ms"] + loops["ar_b1"]["fixed_ms"] / tokens
    loop = loops[f"{proposer}_b1"]
    return (max(tokens / tau - 1.0, 0.0) * loop["round_ms"] + loop["fixed_ms"]) / tokens


def interleaved_predictions(per_round: dict, ratios: dict, proposers: dict, taus: dict, tokens: dict,
                            round_loops: list[dict]) -> dict:
    """For each batch-1 ratio of the interleaved rows (``ratios``: name -> (numerator row,
    denominator row), rows named ``*_b1``; ``proposers``: row -> "-" for AR or its proposer): the
    speed ratio each round's loops predict (`loop_token_ms` of the denominator over the
    numerator's, from the rows' tau and reply lengths) next to the round's measured ratio
    (``per_round``), and the medians over rounds."""
    out = {}
    for name, (num, den) in ratios.items():
        if not (num.endswith("_b1") and den.endswith("_b1")):
            continue
        pred = [loop_token_ms(lp, proposers[den], taus[den], tokens[den])
                / loop_token_ms(lp, proposers[num], taus[num], tokens[num]) for lp in round_loops]
        quot = [m / p for m, p in zip(per_round[name], pred)]
        out[name] = {"measured": float(np.median(per_round[name])), "predicted": float(np.median(pred)),
                     "measured_over_predicted": float(np.median(quot)),
                     "range": [float(min(quot)), float(max(quot))]}
    return out


def regime(lm, ar_rows: list[dict], costs: dict, bandwidth: dict, decode: dict | None = None) -> dict:
    """The target's decode regime: its weight bytes, the rate at which its one-token step reads
    them, each over the lone matrix-vector product's rate, and the (K + 1)-token forward's cost
    over one token's. Read three ways: the forward alone in a loop (``step_*``), the AR decoding
    loop's step with sampling and the cache write (``ar_decode_step_*``, from `decode`:
    `relf_jax.speculative.cost.decode_step_ms`, the prefill and the call left out), and the AR
    rows' batch-1 tokens/s on whole replies (``ar_decode_*``: prefill and call included)."""
    nbytes = weight_bytes(lm)
    one = costs["b1"]["one_token_ms"]
    ar_b1 = max((r["tokens_per_s"] for r in ar_rows if r["batch"] == 1), default=None)
    out = {"weight_bytes": nbytes, "matvec_gb_per_s": bandwidth["gb_per_s"],
           "step_gb_per_s": nbytes / one / 1e6, "step_over_matvec": nbytes / one / 1e6 / bandwidth["gb_per_s"],
           "forward_cost_ratio_b1": costs["b1"]["ratio"]}
    if decode is not None:
        out["ar_decode_step"] = decode
        out["ar_decode_step_gb_per_s"] = nbytes / decode["step_ms"] / 1e6
        out["ar_decode_step_over_matvec"] = out["ar_decode_step_gb_per_s"] / bandwidth["gb_per_s"]
    if ar_b1:
        out["ar_decode_gb_per_s"] = nbytes * ar_b1 / 1e9
        out["ar_decode_over_matvec"] = out["ar_decode_gb_per_s"] / bandwidth["gb_per_s"]
    return out


def host() -> dict:
    """The CPU the bench ran on, as far as its regime depends on it: model name, cores, the
    last-level cache, the widest vector ISA, and whether the CPU small-matmul kernel built
    (``kernels_cpu``: which product a 2-8-row step takes). Fields this OS does not expose are None."""
    from kernels_cpu import small_matmul

    model, flags = None, ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model is None:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    llc = last_level_cache()
    isa = next((n for n, f in (("avx512", " avx512f"), ("avx2", " avx2"), ("neon", " asimd")) if f in flags), None)
    return {"cpu": model, "cores": os.cpu_count(), "last_level_cache": llc and f"L{llc[0]} {llc[1] >> 20} MiB",
            "vector_isa": isa, "small_matmul_kernel": small_matmul.available(),
            "small_matmul_kernel_unavailable": small_matmul.unavailable_reason() or None}


def best_case(tau: float, costs: dict) -> float:
    """The speedup a round of `k` drafts at `tau` reaches with free drafts on this target at batch 1
    (tau over the (K + 1)-token forward's cost): the ceiling the forward cost alone sets."""
    return tau / costs["b1"]["ratio"]


# wide shapes, random weights: whether a model past the caches verifies K + 1 tokens for about the
# price of one here (what speculative decoding's speedup rests on); (d_model, layers, heads, mlp)
WIDE_SHAPES = ((1024, 2, 16, 4096), (768, 2, 12, 3072))


def wide_probe(k: int, vocab: int = 1024, shapes=WIDE_SHAPES, layouts=("in_out", "out_in")) -> list[dict]:
    """`forward_costs` at batch 1 of randomly initialised wide AR models (no training needed: the
    cost does not depend on the weights' values) in each weight layout (`ModelConfig.weight_layout`),
    with their weight bytes and the rate their one-token step reads them."""
    import types

    from flax import nnx

    from relf_jax.config.schema import ModelConfig
    from relf_jax.models import build_model
    from relf_jax.speculative.cost import forward_costs

    out = []
    for (d, layers, heads, mlp), layout in ((s, lay) for s in shapes for lay in layouts):
        cfg = ModelConfig(vocab_size=vocab, d_model=d, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                          mlp_dim=mlp, max_seq_len=256, weight_layout=layout)
        graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))
        lm = types.SimpleNamespace(graphdef=graphdef, params=params, model_cfg=cfg)
        cost = forward_costs(lm, k, batches=(1,), reps=5)["b1"]
        nbytes = weight_bytes(lm)
        out.append({"d_model": d, "num_layers": layers, "mlp_dim": mlp, "weight_layout": layout,
                    "weight_bytes": nbytes, **cost,
                    "step_gb_per_s": nbytes / cost["one_token_ms"] / 1e6})
        print(f"[bench spec] wide d={d} L={layers} {layout}: {nbytes / 1e6:.0f} MB, "
              f"one token {cost['one_token_ms']:.2f} ms "
              f"({out[-1]['step_gb_per_s']:.1f} GB/s), {k + 1} tokens x{cost['ratio']:.2f}", flush=True)
    return out


def preset_forward_cost(preset: str, k: int, vocab: int) -> dict:
    """`forward_costs` at batch 1 and 8 of a randomly initialised AR model of `preset`'s shape
    (another preset's regime, measured in this run without training it), with its weight bytes."""
    import dataclasses
    import types

    from flax import nnx

    from relf_jax.config import make_config
    from relf_jax.models import build_model
    from relf_jax.speculative.cost import forward_costs

    cfg = dataclasses.replace(make_config(preset).model, vocab_size=vocab)
    graphdef, params = nnx.split(build_model(cfg, nnx.Rngs(0)))
    lm = types.SimpleNamespace(graphdef=graphdef, params=params, model_cfg=cfg)
    return {"preset": preset, "weight_bytes": weight_bytes(lm), **forward_costs(lm, k, reps=5)}
