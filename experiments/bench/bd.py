"""`relf-jax bench bd`: block diffusion vs AR on `synthetic_chat` under the exact judge, per budget.

Composition only (every step is a library call). For each training budget (optimizer
steps; default 600 and 1,200 on the `cpu` preset, ``--budgets`` to change) it trains an AR model and
a block-diffusion model of the same width and depth on the same data, batch and row length, and
samples whole conversations (unconditional, up to ``seq_len`` tokens) from both:

- AR: the temperature sweep (`AR_TEMPERATURES` and `AR_HIGH_TEMPERATURES`) that block-diffusion
  rows are compared against at matched entropy (AR gen PPL interpolated in log space at the
  row's entropy, `ar_ppl_at_entropy`);
- block diffusion (block ``model.block_size``, threshold ``sample.threshold``): the default
  decoder (a position's confidence is its top probability) at temperatures `BD_TEMPERATURES`,
  the old commit rule (confidence of the sampled token) at T = 1, and lower thresholds
  (`LOWER_THRESHOLDS`, T = 1): the price of committing more positions per step.

Each row carries gen PPL, entropy, mean words, and for block diffusion the positions committed per
denoising step (every position of the decoded blocks) and the output tokens (up to the stop
token) per step. The report states the text tokens one optimizer step trains on for each family
(AR: packed rows; block diffusion: whole conversations packed per row, each filled up to whole
blocks, `relf_jax.row_mode`), so "the same budget" is given in steps and in text tokens.
``--ablation`` adds, at the first budget, a block-diffusion model trained on the old layout (one
conversation per row, its pad tail in the loss: ``data.rows=documents``).

``--ar-rows FILE`` takes the AR sweep of the budgets a `relf-jax bench relf` report holds from it
(rows marked with ``source``) instead of training and sampling AR again.

Rows are written as they are measured; a rerun with the same ``--out`` keeps the rows it finds
there (same method, variant and budget) and measures only the missing ones, and the models are
cached in the workdir. A plot of gen PPL vs entropy per budget is written next to ``--out``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Sequence

import numpy as np

import relf_jax as rj
from experiments.bench.common import borrowed_ar_rows, text_tokens_per_step
from experiments.bench.relf_variants import AR_TEMPERATURES, QUICK_AR_TEMPERATURES
from relf_jax.config import make_config
from relf_jax.data.prepare import prepare_data, prepare_tokenizer, row_mode
from relf_jax.eval.baselines import ar_ppl_at_entropy
from relf_jax.eval.evaluate import evaluate_samples, exact_judge
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.sampling.recipes import sample_bd
from relf_jax.speculative.recipes import sample

BUDGETS = (600, 1200)
BD_TEMPERATURES = (0.9, 1.0)
# AR temperatures past `AR_TEMPERATURES`: the 1,200-step AR model's T = 1.1 samples sit at 3.20
# nats, below the block-diffusion rows' 3.31-3.34, so the sweep goes on until it brackets them
AR_HIGH_TEMPERATURES = (1.2, 1.3)
QUICK_BD_TEMPERATURES = (1.0,)
# lower thresholds at T = 1: what committing several positions per step costs on this corpus
LOWER_THRESHOLDS = (0.7, 0.5)
TARGET_RATIO, TARGET_TOKENS_PER_STEP, TARGET_THRESHOLD = 1.5, 1.5, 0.95


def bench_bd(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
             budgets: Sequence[int] | None = None, ablation: bool = False, ar_rows: str | None = None) -> dict:
    """`ar_rows`: a `relf-jax bench relf` report whose AR sweep rows (same preset, judge and sample
    count) stand in for this bench's own at the budgets it holds; no AR model is trained there."""
    preset = "tiny" if quick else "cpu"
    root = os.path.abspath(workdir or os.path.join("runs", f"bench_bd_{preset}"))
    budgets = tuple(budgets or ((60, 120) if quick else BUDGETS))
    n = 32 if quick else 256
    t0 = time.perf_counter()
    old = []
    if os.path.exists(out):
        with open(out) as f:
            old = json.load(f).get("rows", [])
    rows = BenchRows(out, preset, old + borrowed_ar_rows(ar_rows, preset, n))
    layout = {}
    plans = [(steps, "bd", []) for steps in budgets]
    if ablation:
        plans.append((budgets[0], "bd_documents", ["data.rows=documents"]))
    for steps in budgets:
        wd = os.path.join(root, f"steps{steps}")
        cfg = make_config(preset, [*overrides, f"train.steps={steps}"], workdir=wd)
        if rows.judge is None:
            rows.judge = exact_judge(cfg)
            layout = _layout(cfg, make_config(preset, [*overrides, "model=bd"], workdir=wd))
        ar_lm = None
        for t in QUICK_AR_TEMPERATURES if quick else AR_TEMPERATURES + AR_HIGH_TEMPERATURES:
            key = {"method": f"ar T={t:g}", "variant": "ar", "train_steps": steps, "temperature": t}
            if ar_lm is None and rows.have(**key) is None:
                rj.train(cfg)
                ar_lm = load_model(wd, "ar")
            sc = dataclasses.replace(cfg.sample, temperature=t, top_k=0, top_p=1.0,
                                     max_new_tokens=cfg.data.seq_len - 1, num_samples=n)
            rows.measure(key, lambda sc=sc, ar_lm=ar_lm: sample(ar_lm, n=n, sample_cfg=sc))
    for steps, variant, extra in plans:
        bd_rows(rows, preset, overrides, root, steps, variant, extra, n, quick)
    base = make_config(preset, list(overrides))
    report = {"preset": preset, "complete": True, "num_samples": n, "budgets_steps": list(budgets),
              "text_tokens_per_step": layout,
              "text_tokens": {f"{fam}_steps{s}": layout[fam] * s for fam in layout for s in budgets},
              "positions_per_step": base.train.batch_size * base.data.seq_len,
              "rows": rows.rows, "targets": targets(rows.rows, budgets), "judge": rows.judge.name,
              "wall_s": time.perf_counter() - t0}
    write_json(out, report)
    plot(rows.rows, budgets, os.path.splitext(out)[0] + "_quality.png")
    print(json.dumps(report["targets"], indent=2))
    return report


class BenchRows:
    """The rows of one run, written to `out` as each is measured; a row found in `old` (same keys)
    is taken from there instead of measured again."""

    def __init__(self, out: str, preset: str, old: list[dict]):
        self.out, self.preset, self.old, self.rows, self.judge = out, preset, old, [], None

    def have(self, **kw):
        return next((r for r in self.old if all(r.get(k) == v for k, v in kw.items())), None)

    def record(self, row: dict) -> None:
        self.rows.append(row)
        write_json(self.out, {"preset": self.preset, "complete": False, "rows": self.rows})
        extra = (f"  {row['committed_per_step']:.2f} committed / {row['tokens_per_step']:.2f} output tokens per step"
                 if row.get("tokens_per_step") else "")
        print(f"[bench bd] {row['train_steps']:>5} steps {row['method']:>28}: gen PPL {row['gen_ppl']:8.2f}  "
              f"entropy {row['entropy']:.2f}  {row['mean_tokens']:.1f} words{extra}", flush=True)

    def measure(self, key: dict, run) -> None:
        """The row of `key`: found in `old`, else the samples of `run()` judged."""
        row = self.have(**key)
        if row is None:
            s = run()
            q = evaluate_samples(s, self.judge)
            row = {**key, "gen_ppl": q["gen_ppl"], "entropy": q["entropy"], "pooled_entropy": q["pooled_entropy"],
                   "mean_tokens": q["mean_tokens"],
                   "distinct_2": q["distinct_2"], "complete": float(np.mean(s.complete)), "seconds": s.seconds}
            if s.denoise_steps:
                # committed_per_step: every position of the decoded blocks (the decoder's rate);
                # tokens_per_step: the output up to the stop token only
                row.update(committed_per_step=s.denoise_commits / s.denoise_steps,
                           tokens_per_step=s.tokens / s.denoise_steps,
                           denoise_steps_per_sample=s.denoise_steps / len(s.texts))
        self.record(row)


def _layout(cfg, bd_cfg) -> dict:
    """Text tokens one optimizer step trains on, per family and row layout."""
    builder = prepare_data(cfg)
    tok = prepare_tokenizer(cfg, builder)
    return {"ar": text_tokens_per_step(cfg, builder, tok, row_mode(cfg), 1, batches=20),
            "bd": text_tokens_per_step(bd_cfg, builder, tok, row_mode(bd_cfg), bd_cfg.model.block_size,
                                       batches=20),
            "bd_documents": text_tokens_per_step(bd_cfg, builder, tok, "documents", 1, batches=20)}


def bd_rows(rows: BenchRows, preset: str, overrides: Sequence[str], root: str, steps: int, variant: str,
             extra: Sequence[str], n: int, quick: bool) -> None:
    """A block-diffusion model of `variant` at `steps`: its rows at each temperature, the old commit
    rule and (the default layout) lower thresholds."""
    wd = os.path.join(root, f"steps{steps}" if variant == "bd" else f"steps{steps}_{variant}")
    bcfg = make_config(preset, [*overrides, f"train.steps={steps}", "model=bd", *extra], workdir=wd)
    thr = bcfg.sample.threshold
    runs = [(t, "max", thr) for t in (QUICK_BD_TEMPERATURES if quick else BD_TEMPERATURES)] + [(1.0, "sampled", thr)]
    runs += [(1.0, "max", x) for x in ((LOWER_THRESHOLDS[:1] if quick else LOWER_THRESHOLDS)
                                       if variant == "bd" else ())]
    if variant != "bd":
        runs = [(1.0, "max", thr), (1.0, "sampled", thr)]
    keys = [{"method": f"bd T={t:g}" + ("" if rule == "max" else " sampled-confidence")
             + ("" if x == thr else f" thr={x:g}"), "variant": variant, "train_steps": steps, "temperature": t,
             "confidence": rule, "threshold": x, "block_size": bcfg.model.block_size} for t, rule, x in runs]
    lm = None
    if any(rows.have(**key) is None for key in keys):  # a budget whose rows are all in --out is not retrained
        rj.train(bcfg)
        lm = load_model(wd, "bd")
    for key in keys:
        rows.measure(key, lambda key=key: sample_bd(lm, n=n, sample_cfg=dataclasses.replace(
            lm.cfg.sample, temperature=key["temperature"], confidence=key["confidence"], num_samples=n,
            threshold=key["threshold"], max_new_tokens=bcfg.data.seq_len - 1)))


def targets(rows: Sequence[dict], budgets: Sequence[int]) -> dict:
    """Per budget: each default block-diffusion row's gen PPL over AR's at its entropy (AR sweep of
    the same budget, interpolated; `entropy_outside_ar_sweep_nats` > 0 means extrapolated), its
    tokens per denoising step; the row nearest AR's entropy range is the headline; and whether gen
    PPL falls with budget (T = 1 rows)."""
    out = {}
    curve = []
    for steps in budgets:
        ar = [r for r in rows if r["variant"] == "ar" and r["train_steps"] == steps and r["gen_ppl"]]
        bd = [r for r in rows if r["variant"] == "bd" and r["train_steps"] == steps and r.get("confidence") == "max"
              and r["temperature"] > 0]
        lower = {r["method"]: {"threshold": r["threshold"], "gen_ppl": r["gen_ppl"], "entropy": r["entropy"],
                               "committed_per_step": r.get("committed_per_step")}
                 for r in bd if r.get("threshold", TARGET_THRESHOLD) != TARGET_THRESHOLD}
        bd = [r for r in bd if r.get("threshold", TARGET_THRESHOLD) == TARGET_THRESHOLD]
        if not ar or not bd:
            continue
        per = {}
        for r in bd:
            ppl, gap = ar_ppl_at_entropy(ar, r["entropy"])
            per[r["method"]] = {"gen_ppl": r["gen_ppl"], "entropy": r["entropy"], "ar_gen_ppl_interpolated": ppl,
                                "entropy_outside_ar_sweep_nats": gap, "ratio": r["gen_ppl"] / ppl,
                                "committed_per_step": r.get("committed_per_step"),
                                "tokens_per_step": r.get("tokens_per_step")}
            if "pooled_entropy" in r and all("pooled_entropy" in a for a in ar):
                # the read-off at the pooled entropy, which does not grow with sample length
                ppl_p, gap_p = ar_ppl_at_entropy(ar, r["pooled_entropy"], key="pooled_entropy")
                per[r["method"]].update(pooled_entropy=r["pooled_entropy"], ar_gen_ppl_at_pooled=ppl_p,
                                        pooled_outside_ar_sweep_nats=gap_p, ratio_pooled=r["gen_ppl"] / ppl_p)
        best = min(per.values(), key=lambda x: (x["entropy_outside_ar_sweep_nats"] > 0, x["ratio"]))
        out[f"steps{steps}"] = {
            "rows": per, "headline": best,
            "ratio_target": f"<= {TARGET_RATIO}", "tokens_per_step_target": f">= {TARGET_TOKENS_PER_STEP}",
            "ratio_met": best["ratio"] <= TARGET_RATIO and best["entropy_outside_ar_sweep_nats"] == 0,
            "tokens_per_step_met": (best["committed_per_step"] or 0) >= TARGET_TOKENS_PER_STEP,
            "lower_thresholds_t1": lower}
        t1 = next((r for r in bd if r["temperature"] == 1.0), None)
        if t1 is not None:
            curve.append((steps, t1["gen_ppl"], t1["entropy"]))
    if curve:
        out["bd_t1_gen_ppl_by_budget"] = {str(s): {"gen_ppl": p, "entropy": e} for s, p, e in curve}
        out["bd_t1_gen_ppl_falls_with_budget"] = all(b[1] < a[1] for a, b in itertools.pairwise(curve))
    return out


def plot(rows: Sequence[dict], budgets: Sequence[int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, steps in enumerate(budgets):
        color = f"C{i}"
        ar = sorted((r["entropy"], r["gen_ppl"]) for r in rows if r["variant"] == "ar" and r["train_steps"] == steps
                    and r["gen_ppl"])
        if ar:
            ax.plot(*zip(*ar), "-o", color=color, ms=3, label=f"AR sweep, {steps} steps")
        bd = [r for r in rows if r["variant"] == "bd" and r["train_steps"] == steps and r["gen_ppl"]]
        for r in bd:
            marker = "x" if r.get("confidence") == "sampled" else ("s" if r["temperature"] == 0 else "^")
            ax.scatter(r["entropy"], r["gen_ppl"], marker=marker, color=color, s=40)
            ax.annotate(r["method"].replace("bd ", "").replace("sampled-confidence", "old rule"),
                        (r["entropy"], r["gen_ppl"]), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for r in rows:
        if r["variant"] == "bd_documents" and r["gen_ppl"]:
            ax.scatter(r["entropy"], r["gen_ppl"], marker="v", color="gray", s=40)
            ax.annotate(f"old layout T={r['temperature']:g}" + (" old rule" if r.get("confidence") == "sampled"
                                                                 else ""),
                        (r["entropy"], r["gen_ppl"]), textcoords="offset points", xytext=(3, -9), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("mean unigram entropy (nats)")
    ax.set_ylabel("gen PPL (exact judge)")
    ax.set_title("block diffusion (markers) vs AR sweeps (lines)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
