"""`relf-jax bench spec`: AR vs speculative decoding (standard / NSD / greedy rules, draft-model,
prompt-lookup and corpus n-gram proposers) at batch 1 and 8, temperature 1.0, 0.7 and 0 (the last
two not with --quick), K = 4 and, at batch 1 and T = 1, K = 2 and 6: tokens/s, tau (tokens per target
forward) and, for quality, gen PPL (exact judge, replies scored given their prompts) and entropy;
plus the target's forward cost over K + 1 tokens relative to one token (`target_forward_cost`,
and `target_forward_cost_xla_dot` without the CPU small-matmul kernel), which decides whether
speculation can pay on this hardware, the host (CPU, last-level cache, vector ISA), and the cost model
(`experiments.bench.spec_cost`): where a round spends its time, the predicted against the measured
speedups, and the target's memory regime; the target rows timed round-robin (`interleaved_timing`)
and their quality on 256 more prompts at matched entropy (`experiments.bench.spec_quality`).

Every row of a benchmark is measured in the same process, one after the other, on the same
prompts, so ratios between rows are meaningful on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench import spec_cost
from experiments.bench.common import ensure_target_and_draft, find_row, held_out_prompts, reply_quality
from experiments.bench.spec_quality import QUALITY_PROMPTS, QUICK_QUALITY_PROMPTS, SHARP_DRAFT_SCALE, quality_section
from kernels_pallas import dispatch
from relf_jax.io import write_json
from relf_jax.methods import Autoregressive, Speculative, parse_proposer
from relf_jax.speculative.cost import forward_costs

# the draft of a target past the caches: a model that stays in them (~0.5M parameters), so a draft
# step costs a few percent of a target step (the default draft, half the target's width and
# depth, would cost a quarter)
SMALL_DRAFT = ("model.d_model=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
               "model.mlp_dim=384", "model.head_dim=0", "model.weight_layout=in_out")
# cpu-wide's draft is distilled for twice the target's steps: at 300 (half, the demo's rule) its
# distillation CE was still falling and tau was 2.04 at T = 1; at 1,200, 3.43 (docs/speculative.md)
WIDE_DRAFT_STEPS = 1200


def bench_spec(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
               preset: str | None = None, draft_steps: int | None = None) -> dict:
    from relf_jax.eval.evaluate import exact_judge
    from relf_jax.speculative.recipes import proposer_inputs, sample

    preset = preset or ("tiny" if quick else "cpu")
    workdir = workdir or os.path.join("runs", f"bench_spec_{preset}")
    wide = preset == "cpu-wide"
    cfg, lm, draft = ensure_target_and_draft(preset, workdir, overrides, SMALL_DRAFT if wide else (),
                                             distill_steps=draft_steps or (WIDE_DRAFT_STEPS if wide else None))
    judge = exact_judge(cfg)
    max_new = 32 if quick else 64
    n_prompts = 8 if quick else 16
    prompts = held_out_prompts(cfg, n_prompts)
    k = 4
    # (method, rule, proposer, NSD top-p, K, the draft's temperature scale)
    variants = [("ar", "none", "-", None, None, 1.0)]
    for proposer in ("draft", "prompt_lookup", "corpus_ngram"):
        variants += [("speculative", "standard", proposer, None, k, 1.0),
                     ("speculative", "greedy", proposer, None, k, 1.0)]
        for nsd in ((0.8, 0.9, 0.95) if proposer == "draft" else (0.9,)):
            variants.append(("speculative", "nsd", proposer, nsd, k, 1.0))
        if proposer == "draft":  # NSD with the draft sampling at half the temperature
            variants.append(("speculative", "nsd", proposer, 0.9, k, SHARP_DRAFT_SCALE))
    # K swept at batch 1, T = 1: the draft model and the n-gram table, both rules
    swept = [("speculative", rule, proposer, 0.9 if rule == "nsd" else None, other, 1.0)
             for other in (2, 6) for proposer in ("draft", "corpus_ngram") for rule in ("standard", "nsd")]
    table = None
    rows = []
    t0 = time.perf_counter()
    for batch in (1, 8):
        for temperature in ((1.0,) if quick else (1.0, 0.7, 0.0)):
            sc = dataclasses.replace(cfg.sample, batch_size=batch, max_new_tokens=max_new, temperature=temperature,
                                     top_k=0, top_p=1.0, seed=0)
            for method, rule, proposer, nsd, kk, scale in variants + (swept if (batch, temperature) == (1, 1.0)
                                                                     else []):
                chosen = Autoregressive() if rule == "none" else Speculative(
                    rule=rule, k=kk, nsd_top_p=nsd or 0.9, draft_temperature_scale=scale,
                    proposer=parse_proposer(proposer, draft=draft))
                if proposer == "corpus_ngram" and table is None:
                    table = proposer_inputs(lm, chosen)[1]  # built once, for every row and the profile
                s = sample(lm, prompts=prompts, sample_cfg=sc, method=chosen, ngram_table=table)
                q = reply_quality(judge, prompts, s.texts, s.complete)
                q = {"gen_ppl": q["gen_ppl"], "entropy": q["entropy"], "pooled_entropy": q["pooled_entropy"]}
                row = {"method": method if rule == "none" else f"{rule}" + (f"@{nsd}" if nsd else "")
                       + ("" if scale == 1.0 else f"/s{scale:g}"),
                       "rule": rule, "proposer": proposer, "nsd_top_p": nsd, "draft_temperature_scale": scale,
                       "temperature": temperature,
                       "batch": batch, "k": kk, "tokens_per_s": s.tokens_per_s,
                       "tau": s.tau, "mean_tokens": s.tokens / len(prompts), **q}
                rows.append(row)
                print(f"[bench spec] b={batch} T={temperature} k={kk or '-'} {row['method']:>12} {proposer:>13}: "
                      f"{s.tokens_per_s:8.1f} tok/s  tau {s.tau:4.2f}  gen PPL {q['gen_ppl']:7.2f}  "
                      f"entropy {q['entropy']:.2f}", flush=True)
    wall = time.perf_counter() - t0
    interleaved = interleaved_timing(
        lm, prompts, cfg, draft, table, k, max_new, reps=2 if quick else 5,
        loops=lambda: spec_cost.decode_loops(lm, draft, table, k=k, proposers=("draft", "corpus_ngram"), reps=1,
                                             verbose=False))
    quality = quality_section(lm, cfg, draft, table, judge,
                              held_out_prompts(cfg, QUICK_QUALITY_PROMPTS if quick else QUALITY_PROMPTS, seed=54321),
                              k, max_new)
    # verification cost: K + 1 tokens in one target forward vs one token
    costs = forward_costs(lm, k)
    with dispatch.references():  # the same forwards through XLA's dot alone (no CPU kernel)
        costs_xla = forward_costs(lm, k)
    profs = spec_cost.profiles(lm, draft, table, k=k)
    bandwidth = spec_cost.matvec_bandwidth()
    loops = spec_cost.decode_loops(lm, draft, table, k=k, reps=3 if quick else 5)
    preds = spec_cost.predictions(rows, profs, k, costs, loops)
    report = {"rows": rows, "ratios": _spec_ratios(rows, (1.0,) if quick else (1.0, 0.7, 0.0), k),
              "preset": preset, "draft_distill_steps": draft.step, "k": k, "max_new_tokens": max_new,
              "num_prompts": n_prompts, "wall_s": wall,
              "draft_cost_ratio": _cost_ratio(lm, draft), "target_forward_cost": costs,
              "target_forward_cost_xla_dot": costs_xla, "host": spec_cost.host(),
              "interleaved": interleaved, "quality": quality, "round_profile": profs, "cost_model": preds,
              "matvec": bandwidth,
              "decode_loops": loops,
              "regime": spec_cost.regime(lm, [r for r in rows if r["rule"] == "none"], costs, bandwidth,
                                         loops["ar_b1"]),
              # past the caches: random-weight wide shapes' K + 1-token cost (not with --quick)
              "wide_probe": [] if quick else spec_cost.wide_probe(k),
              # the compute-bound contrast: the `cpu` preset's shape (random weights) on this machine
              "cpu_preset_forward_cost": (None if quick or preset == "cpu"
                                          else spec_cost.preset_forward_cost("cpu", k, lm.model_cfg.vocab_size))}
    write_json(out, report)
    print(json.dumps(report["ratios"], indent=2))
    for p in preds:
        print(f"[bench spec] cost model b={p['batch']} T={p['temperature']} {p['method']:>12} {p['proposer']:>13}: "
              f"measured x{p['measured_speedup']:.2f}  predicted x{p['predicted_speedup']:.2f}  (AR step "
              f"{p['ar_step_ms']:.2f} ms, {p['ar_overhead_ms']:.2f} beyond its forward; round "
              f"{p['round_measured_ms']:.2f} ms: verify {p['verify_ms']:.2f}, bookkeeping {p['bookkeeping_ms']:.2f}, "
              f"outside the round "
              f"{p['outside_round_ms']:.2f})" + (f"; with the prefill x{p['predicted_speedup_with_prefill']:.2f}"
                                                 if "predicted_speedup_with_prefill" in p else ""))
    print(json.dumps(report["regime"], indent=2))
    print(json.dumps(interleaved["ratios"], indent=2))
    print(json.dumps(quality["ratios"], indent=2))
    return report


# the rows the targets compare, timed again interleaved: (name, batch, rule, proposer, nsd_top_p,
# the draft's temperature scale, temperature). The standard rule at T = 0.7 is the exact rule at
# about the sharpened NSD row's per-reply entropy (`spec_quality` measures both on 256 prompts; at
# the pooled entropy the match is T = 0.6, `spec_sharp`)
INTERLEAVED = (("ar_b1", 1, "none", "-", None, 1.0, 1.0), ("standard_draft_b1", 1, "standard", "draft", None, 1.0, 1.0),
               ("nsd0.9_draft_b1", 1, "nsd", "draft", 0.9, 1.0, 1.0),
               ("nsd0.9_ngram_b1", 1, "nsd", "corpus_ngram", 0.9, 1.0, 1.0),
               ("nsd0.9_sharp_draft_b1", 1, "nsd", "draft", 0.9, SHARP_DRAFT_SCALE, 1.0),
               ("standard_draft_T0.7_b1", 1, "standard", "draft", None, 1.0, 0.7),
               ("ar_b8", 8, "none", "-", None, 1.0, 1.0), ("standard_draft_b8", 8, "standard", "draft", None, 1.0, 1.0))
# ratio name -> (numerator, denominator)
INTERLEAVED_RATIOS = {"standard_over_ar_b1": ("standard_draft_b1", "ar_b1"),
                      "nsd0.9_ngram_over_ar_b1": ("nsd0.9_ngram_b1", "ar_b1"),
                      "nsd0.9_over_standard_b1": ("nsd0.9_draft_b1", "standard_draft_b1"),
                      "nsd0.9_sharp_over_standard_b1": ("nsd0.9_sharp_draft_b1", "standard_draft_b1"),
                      "nsd0.9_sharp_over_standard_T0.7_b1": ("nsd0.9_sharp_draft_b1", "standard_draft_T0.7_b1"),
                      "standard_over_ar_b8": ("standard_draft_b8", "ar_b8")}


def interleaved_timing(lm, prompts, cfg, draft, table, k: int, max_new: int, reps: int, loops=None,
                       rows: tuple = INTERLEAVED, ratios: dict | None = None) -> dict:
    """The target rows (`rows`, as `INTERLEAVED`; K = `k`) timed round-robin: `reps` rounds, each
    decoding the same prompts once with every row, the order rotated by one each round; `ratios`
    (default `INTERLEAVED_RATIOS`) names the ratios taken. A ratio is taken within a
    round (its two rows a few seconds apart) and its median over rounds reported, so a host whose
    speed drifts over the minutes of the sequential sweep moves both sides of it alike.

    `loops` (a callable returning `spec_cost.decode_loops`' dict) is timed once at the end of each
    round; the batch-1 ratios are then predicted from that round's loops and the rows' tau and
    reply lengths (`spec_cost.interleaved_predictions`), in the same stretch as the rows."""
    from relf_jax.speculative.recipes import sample

    def method(rule, proposer, nsd, scale):
        return Autoregressive() if rule == "none" else Speculative(
            rule=rule, k=k, nsd_top_p=nsd or 0.9, draft_temperature_scale=scale,
            proposer=parse_proposer(proposer, draft=draft))

    def run(row):
        _, batch, rule, proposer, nsd, scale, temperature = row
        sc = dataclasses.replace(cfg.sample, batch_size=batch, max_new_tokens=max_new, temperature=temperature,
                                 top_k=0, top_p=1.0, seed=0)
        return sample(lm, prompts=prompts, sample_cfg=sc, method=method(rule, proposer, nsd, scale),
                      ngram_table=table)

    ratios = INTERLEAVED_RATIOS if ratios is None else ratios
    speeds = {row[0]: [] for row in rows}
    taus, mean_tokens, round_loops = {}, {}, []
    for r in range(reps):
        for row in rows[r % len(rows):] + rows[:r % len(rows)]:
            s = run(row)
            speeds[row[0]].append(s.tokens_per_s)
            taus[row[0]] = s.tau
            mean_tokens[row[0]] = s.tokens / len(prompts)
        if loops is not None:
            round_loops.append(loops())
    per_round = {name: [a / b for a, b in zip(speeds[num], speeds[den])] for name, (num, den) in ratios.items()}
    print(f"[bench spec] interleaved, {reps} rounds: " + "  ".join(
        f"{name} {float(np.median(v)):.2f}" for name, v in per_round.items()), flush=True)
    out = {"reps": reps, "tokens_per_s": speeds, "tau": taus, "mean_tokens": mean_tokens,
           "ratios": {name: float(np.median(v)) for name, v in per_round.items()},
           "ratio_range": {name: [float(min(v)), float(max(v))] for name, v in per_round.items()}}
    if round_loops:
        proposers = {row[0]: row[3] for row in rows}
        out["loops"] = round_loops
        out["cost_model"] = spec_cost.interleaved_predictions(per_round, ratios, proposers, taus,
                                                              mean_tokens, round_loops)
        for name, p in out["cost_model"].items():
            print(f"[bench spec] interleaved cost model {name}: measured x{p['measured']:.2f}  predicted with the "
                  f"prefill x{p['predicted']:.2f}  (measured / predicted {p['measured_over_predicted']:.2f}, "
                  f"rounds {p['range'][0]:.2f}-{p['range'][1]:.2f})", flush=True)
    return out


def _spec_ratios(rows, temperatures=(1.0, 0.7), k: int = 4) -> dict:
    out = {}
    for batch in (1, 8):
        for temperature in temperatures:
            base = dict(batch=batch, temperature=temperature)
            ar_row = find_row(rows, rule="none", **base)
            std = find_row(rows, rule="standard", proposer="draft", k=k, **base)
            nsd = find_row(rows, rule="nsd", proposer="draft", nsd_top_p=0.9, k=k, draft_temperature_scale=1.0, **base)
            sharp = find_row(rows, rule="nsd", proposer="draft", nsd_top_p=0.9, k=k,
                             draft_temperature_scale=SHARP_DRAFT_SCALE, **base)
            key = f"b{batch}_T{temperature}"
            ngram = {}
            for rule in ("standard", "nsd"):
                r = find_row(rows, rule=rule, proposer="corpus_ngram", k=k, **base)
                if r is not None:
                    ngram[f"ngram_{rule}_over_ar_tokens_per_s"] = r["tokens_per_s"] / ar_row["tokens_per_s"]
                    ngram[f"ngram_{rule}_gen_ppl_over_ar"] = r["gen_ppl"] / ar_row["gen_ppl"]
            out[key] = {**ngram,
                "standard_over_ar_tokens_per_s": std["tokens_per_s"] / ar_row["tokens_per_s"],
                "nsd0.9_over_standard_tau": nsd["tau"] / std["tau"],
                "nsd0.9_over_standard_tokens_per_s": nsd["tokens_per_s"] / std["tokens_per_s"],
                "nsd0.9_over_ar_tokens_per_s": nsd["tokens_per_s"] / ar_row["tokens_per_s"],
                "nsd0.9_gen_ppl_over_ar": nsd["gen_ppl"] / ar_row["gen_ppl"],
                "nsd0.9_entropy_over_ar": nsd["entropy"] / ar_row["entropy"],
            }
            if sharp is not None:
                out[key].update({"nsd0.9_sharp_over_standard_tau": sharp["tau"] / std["tau"],
                                 "nsd0.9_sharp_over_standard_tokens_per_s": sharp["tokens_per_s"] / std["tokens_per_s"],
                                 "nsd0.9_sharp_entropy_over_ar": sharp["entropy"] / ar_row["entropy"]})
    return out


def _cost_ratio(lm, draft) -> float:
    """Target / draft parameter count (excluding embeddings): how much cheaper a draft step is."""
    import jax

    def count(m):
        return sum(x.size for x in jax.tree.leaves(m.params)) - m.model_cfg.vocab_size * m.model_cfg.d_model

    return count(lm) / max(count(draft), 1)
