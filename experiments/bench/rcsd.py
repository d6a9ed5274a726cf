"""`relf-jax bench rcsd`: does a draft that keeps learning from its own verification traces
(RCSD) accept more than the distilled draft it started from?

Composition only. Same target, same starting distilled draft, temperature 1.0, exact
(standard) verification with K = 4. Three variants, each over the same stream of serving
prompts and with the same budget (serving cycles x prompts, so the same target forwards up to
what acceptance saves; the same optimizer steps per cycle):

- ``a_distilled``: the distilled draft as it is (no online training);
- ``b_online_distill``: the continual loop with the distillation term only (preference weight 0);
- ``c_rcsd``: the continual loop with the RCSD loss (distillation + masked preference at the
  first rejection against the frozen starting draft);
- ``c_rcsd_beta1`` (main scenario only): RCSD with a 10x stronger preference term (beta 1.0
  instead of 0.1), so the preference term's effect shows above the noise of the serving stream.

Context rows (not variants): ``reference``, the same draft shape distilled offline for
``reference_distill_factor`` times the starting draft's steps, on the same held-out prompts:
how much tau the starting draft's shape has left to gain.

Main scenario: ``seeds`` seeds (serving stream and training order differ); tau and tokens/s of
each final draft on held-out prompts. Traffic-shift scenario: a draft distilled on half of the
corpus's topics serves prompts from the other half; tau of every serving cycle (a checkpoint
each) and of the final draft on held-out shifted prompts, against the tau that the draft
distilled on all topics gets on the same prompts (what the shift cost).

Runs resume: each (scenario, seed, variant) keeps its continual-loop directory under the
workdir, and the JSON is rewritten after every finished variant.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench.common import draft_steps, ensure_target_and_draft
from relf_jax.io import write_json

VARIANTS = ("a_distilled", "b_online_distill", "c_rcsd")
MAIN_VARIANTS = (*VARIANTS, "c_rcsd_beta1")


@dataclasses.dataclass(frozen=True)
class RCSDBenchSizes:
    seeds: int = 3
    cycles: int = 6
    # Online budget. Each example is a whole traced reply (~48 supervised positions); 20 steps of
    # batch 8 per cycle on 32 prompts (the first version) moved tau by under 2 %.
    prompts_per_cycle: int = 128
    steps_per_cycle: int = 60
    batch_size: int = 32
    eval_prompts: int = 64
    max_new_tokens: int = 48
    prompt_len: int = 32
    learning_rate: float = 3e-3
    shift_distill_steps: int = 300
    reference_distill_factor: int = 4  # x the starting draft's distillation steps; 0: no reference row


QUICK = RCSDBenchSizes(seeds=3, cycles=2, prompts_per_cycle=8, steps_per_cycle=5, batch_size=8, eval_prompts=8,
                       max_new_tokens=16, prompt_len=32, learning_rate=1e-3, shift_distill_steps=40,
                       reference_distill_factor=0)


def _prompt_ids(grammar, tok, n: int, seed: int, topics=None) -> list[list[int]]:
    from relf_jax.data.tokenizer import encode_prompt

    return [encode_prompt(tok, info["prompt"]) for info in grammar.sample_with_info(n, seed, topics)]


def _loss(variant: str):
    from relf_jax.speculative.rcsd import RCSDLossSettings

    if variant == "b_online_distill":
        return RCSDLossSettings(pref_weight=0.0)
    if variant == "c_rcsd_beta1":
        return RCSDLossSettings(beta=1.0)
    return RCSDLossSettings()


def _run_variant(target, draft, run_dir: str, variant: str, settings, batches, eval_ids, *, eval_seed: int):
    """Serving tau per cycle and the final draft's tau / tokens/s on `eval_ids`."""
    from relf_jax.speculative.continual import ContinualDraftTrainer

    trainer = ContinualDraftTrainer(target, draft, run_dir, dataclasses.replace(settings, loss=_loss(variant)))
    if variant == "a_distilled":  # no training: serve each cycle's prompts with the fixed draft
        serving = [trainer.serve(b, seed=settings.seed * 1000 + c + 1, log=False)["tau"]
                   for c, b in enumerate(batches)]
    else:
        trainer.run(batches)
        serving = [h["tau"] for h in trainer.progress()["history"]]
    final = trainer.serve(eval_ids, seed=eval_seed, log=False)
    return serving, final


def bench_rcsd(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = ()) -> dict:
    from relf_jax.eval.evaluate import exact_judge
    from relf_jax.loading import load_model
    from relf_jax.speculative.continual import ContinualSettings
    from relf_jax.speculative.recipes import train_draft

    preset = "tiny" if quick else "cpu"
    sizes = QUICK if quick else RCSDBenchSizes()
    workdir = workdir or os.path.join("runs", f"bench_spec_{preset}")  # shares models with `bench spec`
    cfg, target, draft = ensure_target_and_draft(preset, workdir, overrides)
    grammar = exact_judge(cfg).grammar
    tok = target.tokenizer
    base = ContinualSettings(steps_per_cycle=sizes.steps_per_cycle, batch_size=sizes.batch_size, serve_batch=8,
                             learning_rate=sizes.learning_rate, k=4, rule="standard", temperature=1.0,
                             max_new_tokens=sizes.max_new_tokens, prompt_len=sizes.prompt_len)
    # the sizes name the directory, so a resumed run never mixes budgets
    tag = hashlib.sha1(json.dumps(dataclasses.asdict(sizes), sort_keys=True).encode()).hexdigest()[:8]
    root = os.path.join(workdir, f"bench_rcsd_{tag}")
    report = {"rows": [], "shift": {}, "preset": preset, "sizes": dataclasses.asdict(sizes), "k": 4,
              "rule": "standard", "temperature": 1.0}
    t0 = time.perf_counter()

    def save():
        report["wall_s"] = time.perf_counter() - t0
        report["summary"] = summary(report)
        write_json(out, report)

    # ---------------------------------------------------------------- main scenario
    eval_ids = _prompt_ids(grammar, tok, sizes.eval_prompts, seed=777_000)
    n = sizes.cycles * sizes.prompts_per_cycle
    for seed in range(sizes.seeds):
        stream = _prompt_ids(grammar, tok, n, seed=1_000 + seed)
        batches = [stream[c * sizes.prompts_per_cycle:(c + 1) * sizes.prompts_per_cycle] for c in range(sizes.cycles)]
        for variant in MAIN_VARIANTS:
            serving, final = _run_variant(target, draft, os.path.join(root, f"seed{seed}", variant), variant,
                                          dataclasses.replace(base, seed=seed), batches, eval_ids, eval_seed=4242)
            row = {"variant": variant, "seed": seed, "tau": final["tau"], "tokens_per_s": final["tokens_per_s"],
                   "serving_tau": serving}
            report["rows"].append(row)
            print(f"[bench rcsd] seed {seed} {variant:>16}: tau {final['tau']:.3f}  "
                  f"{final['tokens_per_s']:8.1f} tok/s  serving tau {[round(x, 2) for x in serving]}", flush=True)
            save()

    # ---------------------------------------------------------------- headroom of the draft's shape
    if sizes.reference_distill_factor:
        ref_steps = sizes.reference_distill_factor * draft_steps(cfg)
        ref_dir = os.path.join(workdir, f"draft_steps{ref_steps}")
        train_draft(workdir, [f"train.steps={ref_steps}"], workdir=ref_dir)
        _, ref = _run_variant(target, load_model(ref_dir, "ar"), os.path.join(root, "reference"),
                              "a_distilled", base, [], eval_ids, eval_seed=4242)
        report["reference"] = {"distill_steps": ref_steps, "tau": ref["tau"],
                               "tokens_per_s": ref["tokens_per_s"]}
        print(f"[bench rcsd] reference: the draft distilled {ref_steps} steps: "
              f"tau {ref['tau']:.3f}", flush=True)
        save()

    # ---------------------------------------------------------------- traffic shift
    k_topics = grammar.K
    seen, unseen = list(range(k_topics // 2)), list(range(k_topics // 2, k_topics))
    shift_dir = os.path.join(workdir, "draft_topics_" + "-".join(map(str, seen)))
    train_draft(workdir, [f"data.topics={','.join(map(str, seen))}",
                                    f"train.steps={sizes.shift_distill_steps}"], workdir=shift_dir)
    shifted_draft = load_model(shift_dir, "ar")
    shift_eval = _prompt_ids(grammar, tok, sizes.eval_prompts, seed=888_000, topics=unseen)
    stream = _prompt_ids(grammar, tok, n, seed=2_000, topics=unseen)
    batches = [stream[c * sizes.prompts_per_cycle:(c + 1) * sizes.prompts_per_cycle] for c in range(sizes.cycles)]
    _, full = _run_variant(target, draft, os.path.join(root, "shift", "full_draft"), "a_distilled", base, [],
                           shift_eval, eval_seed=4343)
    report["shift_reference"] = {"seen_topics": seen, "unseen_topics": unseen,
                                 "full_draft_tau": full["tau"]}
    for variant in VARIANTS:
        serving, final = _run_variant(target, shifted_draft, os.path.join(root, "shift", variant), variant, base,
                                      batches, shift_eval, eval_seed=4343)
        report["shift"][variant] = [*serving, final["tau"]]
        print(f"[bench rcsd] shift {variant:>16}: tau per cycle {[round(x, 2) for x in serving]} -> "
              f"held-out {final['tau']:.3f} (full-topic draft {full['tau']:.3f})", flush=True)
        save()
    save()
    print(json.dumps(report["summary"], indent=2))
    return report


def summary(report: dict) -> dict:
    """Mean and spread of tau per variant, ratios to (a), and the shift recovery."""
    out = {}
    by = {}
    for r in report["rows"]:
        by.setdefault(r["variant"], []).append(r)
    for v, rows in by.items():
        taus = np.array([r["tau"] for r in rows])
        tps = np.array([r["tokens_per_s"] for r in rows])
        out[v] = {"tau_mean": float(taus.mean()), "tau_min": float(taus.min()), "tau_max": float(taus.max()),
                  "tau_std": float(taus.std()), "tokens_per_s_mean": float(tps.mean()), "seeds": len(rows)}
    if "a_distilled" in out:
        a = {r["seed"]: r["tau"] for r in by["a_distilled"]}
        for v in MAIN_VARIANTS[1:]:
            if v in by:
                ratios = [r["tau"] / a[r["seed"]] for r in by[v] if r["seed"] in a]
                out[v]["tau_ratio_to_a"] = float(np.mean(ratios)) if ratios else None
    if "b_online_distill" in by and "c_rcsd" in by:
        b = {r["seed"]: r["tau"] for r in by["b_online_distill"]}
        diffs = [r["tau"] - b[r["seed"]] for r in by["c_rcsd"] if r["seed"] in b]
        out["c_minus_b"] = {"mean": float(np.mean(diffs)), "per_seed": diffs} if diffs else None
    if "reference" in report and "a_distilled" in out:
        out["reference_tau_ratio_to_a"] = report["reference"]["tau"] / out["a_distilled"]["tau_mean"]
    ref = report.get("shift_reference")
    if ref and report["shift"]:
        full = ref["full_draft_tau"]
        start = report["shift"].get("a_distilled", [None])[-1]
        out["shift"] = {"full_draft_tau": full, "shifted_draft_tau": start}
        if start is not None:
            lost = full - start
            for v, taus in report["shift"].items():
                out["shift"][f"{v}_recovered_fraction"] = float((taus[-1] - start) / lost) if lost > 0 else None
    return out
