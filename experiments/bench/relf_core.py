"""`relf-jax bench relf --parts core`: issue 35's comparison, at one budget or a budget curve.

For each budget (optimizer steps; ``train.steps`` of the preset unless `budgets` is given): the
AR temperature sweep, the default ReLF (context-reading; 64-NFE stochastic, 16 / 8-NFE Euler),
the paper's plain parametrisation (64-NFE stochastic) and the other `CORE_VARIANTS` (rows like
the default's), all at the same optimizer steps, with the positional-unigram reference once.
Text tokens per step are measured for each row layout and stated. Where the default ReLF-64 row
reads more entropy than every AR row of its budget, the AR sweep goes on upward (0.1 apart, up to
T = `AR_TOP_TEMPERATURE`) until it does not, so the matched-entropy ratio is an interpolation.

Rows are written as they are measured. A rerun with the same `out` keeps the rows it finds there
and trains / samples only what is missing (a model whose rows are all there is not retrained),
so budgets can be added one run at a time. `ar_rows` (a `bench relf` or `bench bd` report of the
same preset and sample count) supplies the AR sweep of the budgets it holds. With more than one
budget a plot of gen PPL against budget is written next to `out` (``<out>_budget.png``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time
from collections.abc import Sequence

import relf_jax as rj
from experiments.bench.common import borrowed_ar_rows, text_tokens_per_step
from experiments.bench.relf_rows import result_row, run_dir
from experiments.bench.relf_targets import ratio
from experiments.bench.relf_variants import AR_TEMPERATURES, CORE_VARIANTS, DEFAULT_CORE_VARIANTS, QUICK_AR_TEMPERATURES
from relf_jax.config import make_config
from relf_jax.data.prepare import prepare_data, prepare_tokenizer, row_mode
from relf_jax.errors import UserError
from relf_jax.eval.baselines import ar_ppl_at_entropy, ar_ppl_at_entropy_fitted, positional_unigram_samples
from relf_jax.eval.evaluate import exact_judge
from relf_jax.flow.generate import sample_relf
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.speculative.recipes import sample

# the sampler rows of each ReLF model: (sampler, NFE, time grid); the plain parametrisation gets the
# first only. The "late" grid (small steps near t = 1, where the posterior decides): on the uniform
# grid the default model's samples lose diversity with no gain in gen PPL (docs/relf.md, "The time
# grid"); Euler on the late grid reads the same at 64 and 128 NFE, so the 64 row is the model's own
# distribution.
SAMPLER_ROWS = (("euler", 64, "late"), ("euler", 16, "late"), ("euler", 8, "late"))
# the highest AR temperature the sweep is extended to while the default ReLF-64 row's entropy lies
# above it (`CoreRun.extend_ar_sweep`)
AR_TOP_TEMPERATURE = 1.6


def bench_relf_core(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
                    preset: str | None = None, num_samples: int | None = None,
                    budgets: Sequence[int] | None = None, variants: Sequence[str] | None = None,
                    ar_rows: str | None = None) -> dict:
    """Issue 35's comparison at each of `budgets` (default: the preset's ``train.steps``) for the
    ReLF models of `variants` (names of `CORE_VARIANTS`; default `DEFAULT_CORE_VARIANTS`). Targets
    per budget: each ReLF row's gen PPL over AR's at matched entropy (the default ReLF-64's: <= 1.5,
    the paper's <= 1.0) and over the positional unigram's; across budgets: whether gen PPL falls."""
    preset = preset or ("tiny" if quick else "cpu")
    variants = tuple(variants or DEFAULT_CORE_VARIANTS)
    unknown = sorted(set(variants) - set(CORE_VARIANTS))
    if unknown:
        raise UserError(f"bench relf core variants must be among {', '.join(CORE_VARIANTS)}; got {unknown}")
    root = os.path.abspath(workdir or os.path.join("runs", f"bench_relf_core_{preset}"))
    base = make_config(preset, list(overrides), workdir=os.path.join(root, "shared"))
    budgets = tuple(budgets or (base.train.steps,))
    n = num_samples or (32 if quick else 256)
    run = CoreRun(out, preset, n, root, base, overrides, ar_rows)
    t0 = time.perf_counter()
    relf_cfg = make_config(preset, [*overrides, "model=relf"], workdir=root)
    tokens = {"ar": float(base.train.batch_size * base.data.seq_len),  # packed: every target is text
              "relf": text_tokens_per_step(relf_cfg, run.builder, run.tok, row_mode(relf_cfg))}
    print(f"[bench relf core] text tokens per step: AR {tokens['ar']:.0f}, ReLF {tokens['relf']:.0f}", flush=True)
    run.measure({"method": "positional unigram", "variant": "reference", "train_steps": 0, "nfe": None},
                lambda: positional_unigram_samples(run.builder, run.tok, n, base.data.seq_len), reflow_rounds=0)
    for steps in budgets:
        run.ar_rows(steps, QUICK_AR_TEMPERATURES if quick else AR_TEMPERATURES, tokens["ar"])
        for variant in variants:
            run.relf_rows(steps, variant, tokens["relf"] if variant == "relf" else None)
        r64 = next((r for r in run.rows if r["variant"] == "relf" and r["nfe"] == 64 and r["train_steps"] == steps
                    and r["gen_ppl"]), None)
        if r64 is not None and not quick:
            run.extend_ar_sweep(steps, r64, tokens["ar"])
    tgt = core_targets(run.rows, tokens, budgets)
    report = {"preset": preset, "complete": True, "parts": ["core"], "num_samples": n, "budgets_steps": list(budgets),
              "tokens_per_step": tokens, "text_tokens": {f"{fam}_steps{s}": tokens[fam] * s for fam in tokens
                                                          for s in budgets},
              "rows": run.rows, "targets": tgt, "judge": run.judge.name, "wall_s": time.perf_counter() - t0}
    write_json(out, report)
    if len(budgets) > 1:
        budget_plot(run.rows, budgets, os.path.splitext(out)[0] + "_budget.png", bd_curve(ar_rows))
    print(json.dumps(tgt, indent=2))
    return report


class CoreRun:
    """The shared data of one run and its rows: those found in `out` (or `ar_rows`) are reused."""

    def __init__(self, out, preset, n, root, base, overrides, ar_rows):
        self.out, self.preset, self.n, self.root, self.base = out, preset, n, root, base
        self.overrides = list(overrides)
        self.builder = prepare_data(base)
        self.tok = prepare_tokenizer(base, self.builder)
        self.judge = exact_judge(base)
        old = []
        if os.path.exists(out):
            with open(out) as f:
                old = json.load(f).get("rows", [])
        self.old = [{"nfe": None, **r} for r in old] + borrowed_ar_rows(ar_rows, preset, n)
        self.rows = []

    def have(self, key: dict):
        return next((r for r in self.old if all(r.get(k) == v for k, v in key.items())), None)

    def measure(self, key: dict, draw, **extra) -> None:
        """The row of `key`: found among the old rows, else `draw()`'s samples judged."""
        row = self.have(key)
        if row is None:
            row = result_row(draw(), self.judge, method=key["method"], nfe=key["nfe"], steps=key["train_steps"],
                             variant=key["variant"], **{k: v for k, v in key.items()
                                                        if k not in ("method", "nfe", "train_steps", "variant")},
                             **extra)
        self.rows.append(row)
        write_json(self.out, {"preset": self.preset, "complete": False, "parts": ["core"], "num_samples": self.n,
                              "rows": self.rows})
        ppl = "   empty" if row["gen_ppl"] is None else f"{row['gen_ppl']:8.2f}"
        print(f"[bench relf core] {row['train_steps']:>5} steps {row['method']:>32} nfe {row['nfe']!s:>4}: "
              f"gen PPL {ppl}  entropy {row['entropy']:.2f}" + (f"  (from {row['source']})" if row.get("source")
                                                               else ""), flush=True)

    def ar_rows(self, steps: int, temperatures: Sequence[float], tokens: float) -> None:
        keys = [{"method": f"ar T={t:g}", "variant": "ar", "train_steps": steps, "nfe": None, "temperature": t}
                for t in temperatures]
        lm = self.ar_model(steps) if any(self.have(k) is None for k in keys) else None
        for key in keys:
            self.ar_row(key, lm, tokens)
        # a borrowed sweep may go on past `temperatures` (bench bd's AR_HIGH_TEMPERATURES): kept
        for r in self.old:
            kept = {x.get("temperature") for x in self.rows if x["variant"] == "ar" and x["train_steps"] == steps}
            if (r["variant"] == "ar" and r["train_steps"] == steps and r.get("temperature") not in kept
                    and r.get("source")):
                self.measure({k: r.get(k) for k in ("method", "variant", "train_steps", "nfe", "temperature")}, None)

    def ar_model(self, steps: int):
        """The AR model of `steps` optimizer steps, trained in this run's workdir unless it is there."""
        wd = run_dir(self.root, f"steps{steps}", self.base)
        rj.train(make_config(self.preset, [*self.overrides, f"train.steps={steps}"], workdir=wd))
        return load_model(wd, "ar")

    def ar_row(self, key: dict, lm, tokens: float) -> None:
        self.measure(key, lambda t=key["temperature"]: sample(lm, n=self.n, sample_cfg=dataclasses.replace(
            lm.cfg.sample, temperature=t, top_k=0, top_p=1.0, max_new_tokens=self.base.data.seq_len - 1,
            num_samples=self.n)), reflow_rounds=0, batch=lm.cfg.sample.batch_size if lm else 8,
            text_tokens_per_step=tokens)

    def extend_ar_sweep(self, steps: int, r64: dict, tokens: float, step: float = 0.1,
                        top: float = AR_TOP_TEMPERATURE) -> None:
        """AR rows at temperatures above the budget's sweep, `step` apart and up to `top`, until one
        reads more entropy than `r64` (the default ReLF-64 row): its ratio to AR is then read inside
        the sweep, not extrapolated past it. The entropy is the pooled one where the rows carry it
        (it does not grow with sample length), else the per-sample column."""
        ekey = "pooled_entropy" if "pooled_entropy" in r64 else "entropy"
        entropy = r64[ekey]

        def sweep():
            return [r for r in self.rows if r["variant"] == "ar" and r["train_steps"] == steps and r["gen_ppl"]]

        if not sweep():
            return
        lm, t = None, max(r["temperature"] for r in sweep())
        while max(r.get(ekey, r["entropy"]) for r in sweep()) <= entropy and t + step <= top + 1e-9:
            t = round(t + step, 6)
            key = {"method": f"ar T={t:g}", "variant": "ar", "train_steps": steps, "nfe": None, "temperature": t}
            if lm is None and self.have(key) is None:
                lm = self.ar_model(steps)
            self.ar_row(key, lm, tokens)

    def relf_rows(self, steps: int, variant: str, tokens: float | None) -> None:
        runs = SAMPLER_ROWS if variant != "plain" else SAMPLER_ROWS[:1]
        keys = [{"method": f"relf {s}" + ("" if variant == "relf" else f" {variant}"), "variant": variant,
                 "train_steps": steps, "nfe": k, "grid": g} for s, k, g in runs]
        if all(self.have(k) is not None for k in keys):
            for key in keys:
                self.measure(key, None)
            return
        vwd = run_dir(self.root, f"steps{steps}_{variant}", self.base)
        rj.train(make_config(self.preset, [*self.overrides, f"train.steps={steps}", "model=relf",
                                           *CORE_VARIANTS[variant]], workdir=vwd))
        lm = load_model(os.path.join(vwd, "relf"), "relf")
        text = tokens if tokens is not None else text_tokens_per_step(lm.cfg, self.builder, self.tok,
                                                                      row_mode(lm.cfg))
        for (sampler, nfe, grid), key in zip(runs, keys, strict=True):
            self.measure(key, lambda s=sampler, k=nfe, g=grid: sample_relf(lm, self.n, nfe=k, sampler=s, grid=g),
                         reflow_rounds=0,
                         batch=lm.cfg.sample.batch_size, text_tokens_per_step=text)


def core_targets(rows: Sequence[dict], tokens: dict, budgets: Sequence[int]) -> dict:
    """Per budget (keys ``steps{N}_...``): each ReLF row's gen PPL over AR's at its entropy (the AR
    sweep of the same budget, interpolated between neighbouring points, and read off quadratic fits
    in temperature, ``ratio_fitted``: `ar_ppl_at_entropy_fitted`; where the rows carry it, the
    same two read-offs at the pooled entropy, ``ratio_pooled`` / ``ratio_pooled_fitted``:
    `relf_jax.eval.metrics.pooled_unigram_entropy`, which does not grow with sample length) and
    over the positional unigram's (the reference row);
    across budgets, per ReLF row kind: its gen PPL, entropy and ratio by budget and whether gen
    PPL falls from each budget to the next."""
    tgt = {"text_tokens_per_step": tokens, "optimizer_steps": list(budgets)}
    uni_row = next((r for r in rows if r["variant"] == "reference"), None)
    curves = {}
    for steps in budgets:
        ar_rows = [r for r in rows if r["variant"] == "ar" and r["train_steps"] == steps and r["gen_ppl"]]
        relf = [r for r in rows if r["variant"] in CORE_VARIANTS and r["train_steps"] == steps and r["gen_ppl"]]
        over_uni = {}
        for r in relf:
            name = f"{r['variant']}_{r['method'].split()[1]}{r['nfe']}"
            over_uni[f"{r['method']} {r['nfe']}"] = ratio(r["gen_ppl"], uni_row["gen_ppl"] if uni_row else None)
            if not ar_rows:
                continue
            ppl, gap = ar_ppl_at_entropy(ar_rows, r["entropy"])
            fitted = ar_ppl_at_entropy_fitted(ar_rows, r["entropy"]) or (None, None, None)
            tgt[f"steps{steps}_{name}_vs_ar_at_matched_entropy"] = {
                "relf_gen_ppl": r["gen_ppl"], "relf_entropy": r["entropy"], "ar_gen_ppl_interpolated": ppl,
                "entropy_outside_ar_sweep_nats": gap, "ratio": ratio(r["gen_ppl"], ppl),
                # the same read-off from quadratic fits of the sweep in temperature (less noise)
                "ar_gen_ppl_fitted": fitted[0], "ar_temperature_fitted": fitted[2],
                "entropy_outside_fitted_sweep_nats": fitted[1], "ratio_fitted": ratio(r["gen_ppl"], fitted[0]),
                "target": "<= 1.5 (paper: <= 1.0)" if r["variant"] == "relf" and r["nfe"] == 64 else None}
            if "pooled_entropy" in r and all("pooled_entropy" in a for a in ar_rows):
                ppl_p, gap_p = ar_ppl_at_entropy(ar_rows, r["pooled_entropy"], key="pooled_entropy")
                fit_p = ar_ppl_at_entropy_fitted(ar_rows, r["pooled_entropy"], key="pooled_entropy") or (None,) * 3
                tgt[f"steps{steps}_{name}_vs_ar_at_matched_entropy"].update(
                    relf_pooled_entropy=r["pooled_entropy"], ar_gen_ppl_at_pooled=ppl_p,
                    pooled_outside_ar_sweep_nats=gap_p, ratio_pooled=ratio(r["gen_ppl"], ppl_p),
                    ar_temperature_pooled_fitted=fit_p[2], ratio_pooled_fitted=ratio(r["gen_ppl"], fit_p[0]))
            curves.setdefault(name, {})[str(steps)] = {"gen_ppl": r["gen_ppl"], "entropy": r["entropy"],
                                                       "ratio_vs_ar": ratio(r["gen_ppl"], ppl),
                                                       "ratio_vs_ar_fitted": ratio(r["gen_ppl"], fitted[0])}
        tgt[f"steps{steps}_over_positional_unigram_gen_ppl"] = over_uni
    if len(budgets) > 1:
        tgt["by_budget"] = curves
        tgt["gen_ppl_falls_with_budget"] = {
            name: all(c[str(b)]["gen_ppl"] < c[str(a)]["gen_ppl"] for a, b in itertools.pairwise(budgets))
            for name, c in curves.items() if all(str(s) in c for s in budgets)}
    return tgt


def bd_curve(path: str | None) -> list[dict]:
    """The default block-diffusion rows (T = 1, top-probability confidence, threshold 0.95) of the
    `bench bd` report at `path`, labelled for `budget_plot`; [] for another report or none."""
    if not path:
        return []
    with open(path) as f:
        rows = json.load(f)["rows"]
    return [{**r, "label": "block diffusion T=1 (bench bd)"} for r in rows
            if r["variant"] == "bd" and r.get("confidence") == "max" and r.get("temperature") == 1.0
            and r.get("threshold") == 0.95]


def budget_plot(rows: Sequence[dict], budgets: Sequence[int], path: str, extra: Sequence[dict] = ()) -> None:
    """Gen PPL against training budget: AR at T = 1 and 0.8, AR interpolated at the default
    ReLF-64's entropy, each ReLF row kind, `extra` rows (e.g. block diffusion, with a ``label``) and
    the positional-unigram reference as a dashed line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))

    def line(pick, label, style):
        pts = [(s, r["gen_ppl"]) for s in budgets for r in rows if r["train_steps"] == s and r["gen_ppl"] and pick(r)]
        if pts:
            ax.plot(*zip(*pts), style, ms=4, label=label)

    for t in (1.0, 0.8):
        line(lambda r, t=t: r["variant"] == "ar" and r.get("temperature") == t, f"AR T={t:g}", "-o")
    matched = []
    for s in budgets:
        ar = [r for r in rows if r["variant"] == "ar" and r["train_steps"] == s and r["gen_ppl"]]
        r64 = next((r for r in rows if r["variant"] == "relf" and r["nfe"] == 64 and r["train_steps"] == s
                    and r["gen_ppl"]), None)
        if ar and r64:
            key = "pooled_entropy" if "pooled_entropy" in r64 and all("pooled_entropy" in a for a in ar) else "entropy"
            matched.append((s, ar_ppl_at_entropy(ar, r64[key], key=key)[0]))
    if matched:
        ax.plot(*zip(*matched), ":o", ms=4, label="AR at the default ReLF-64's entropy")
    for variant in CORE_VARIANTS:
        for sampler, nfe, _ in SAMPLER_ROWS:
            name = "default ReLF" if variant == "relf" else f"ReLF {variant}"
            line(lambda r, v=variant, k=nfe: r["variant"] == v and r["nfe"] == k,
                 f"{name} {sampler} {nfe}", "-s" if nfe == 64 else "--^")
    for label in dict.fromkeys(r["label"] for r in extra):
        pts = sorted((r["train_steps"], r["gen_ppl"]) for r in extra if r["label"] == label and r["gen_ppl"])
        ax.plot(*zip(*pts), "-D", ms=4, label=label)
    uni = next((r for r in rows if r["variant"] == "reference" and r["gen_ppl"]), None)
    if uni:
        ax.axhline(uni["gen_ppl"], color="gray", ls="--", lw=1, label="positional unigram")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(budgets), [str(b) for b in budgets])
    ax.set_xlabel("optimizer steps")
    ax.set_ylabel("gen PPL (exact judge)")
    ax.set_title("gen PPL by training budget")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def entropy_probe(out: str, ar_dir: str, relf_dir: str, temperatures: Sequence[float] = (0.8, 1.0, 1.2, 1.4),
                  n: int = 256, prefix_lengths: Sequence[int] = (16, 32)) -> list[dict]:
    """The core bench's AR model (run folder `ar_dir`) at `temperatures` and its default ReLF-64
    (`relf_dir`), `n` samples each, read five ways: gen PPL, the per-sample mean unigram entropy
    (the entropy column), the pooled entropy, the per-sample entropy of the first k words
    (`prefix_unigram_entropy`, k in `prefix_lengths`, with the share of samples that long): which
    AR temperature matches ReLF's diversity once sample length is taken out; and the topic purity
    (`topic_purity` over the synthetic corpus's topic words; the grammar draws one topic per
    conversation, and its own text reads 0.92 with its noise words: 2,000 conversations, seed 5)."""
    from relf_jax.data.synthetic_chat.lexicon import TOPICS
    from relf_jax.eval.metrics import (
        generative_perplexity,
        mean_unigram_entropy,
        pooled_unigram_entropy,
        prefix_unigram_entropy,
        topic_purity,
    )

    topic_of = {w: topic for topic, lists in TOPICS.items() for words in lists for w in words}

    ar, relf = load_model(ar_dir, "ar"), load_model(relf_dir, "relf")
    judge = exact_judge(ar.cfg)
    rows = []

    def read(name, s):
        words = [judge.tokenize(t) for t in s.texts]
        row = {"name": name, "gen_ppl": generative_perplexity(judge, s.texts, s.complete),
               "entropy": mean_unigram_entropy(words), "pooled_entropy": pooled_unigram_entropy(words),
               "mean_words": sum(map(len, words)) / max(len(words), 1)}
        row["topic_purity"], row["share_with_topic_words"] = topic_purity(words, topic_of)
        for k in prefix_lengths:
            row[f"entropy_first{k}"], row[f"share_first{k}"] = prefix_unigram_entropy(words, k)
        rows.append(row)
        print(f"[bench relf core] entropy probe {name:>20}: gen PPL {row['gen_ppl']:8.2f}  entropy "
              f"{row['entropy']:.3f}  pooled {row['pooled_entropy']:.3f}  topic purity {row['topic_purity']:.3f}  "
              + "  ".join(
                  f"first {k} {row[f'entropy_first{k}']:.3f}" for k in prefix_lengths), flush=True)

    for t in temperatures:
        read(f"ar T={t:g}", sample(ar, n=n, sample_cfg=dataclasses.replace(
            ar.cfg.sample, temperature=t, top_k=0, top_p=1.0, max_new_tokens=ar.cfg.data.seq_len - 1, num_samples=n)))
    sampler, nfe, grid = SAMPLER_ROWS[0]
    read(f"relf {sampler} {nfe} {grid}", sample_relf(relf, n, nfe=nfe, sampler=sampler, grid=grid))
    write_json(out, {"ar_dir": ar_dir, "relf_dir": relf_dir, "num_samples": n, "rows": rows})
    return rows


def bag_of_tokens_topic_posterior(z, t: float, table, log_unigrams, mask):
    """The leave-one-out topic posteriors [L, K] of one row's noised embeddings `z` [L, D] at time
    `t` (Z_j = t e_{x_j} + (1 - t) eps_j): p(k | Z_{-i}) ∝ prod_{j != i, mask_j} sum_w p(w | k)
    N(Z_j; t e_w, (1 - t)^2 I), a uniform topic prior, `log_unigrams` [K, V] log p(w | k), `table`
    [V, D] the embeddings e_w. A reader that knows the topics' word frequencies and ignores word
    order: what the neighbours' noisy embeddings tell of the topic at the least (the grammar's
    exact posterior knows more). At t = 1 the variance floor 1e-8 makes it read the words."""
    import numpy as np
    from scipy.special import logsumexp

    z, table = np.asarray(z, np.float64), np.asarray(table, np.float64)
    var = max((1.0 - t) ** 2, 1e-8)
    # log N(Z_j; t e_w, var I) up to a term of j alone (it cancels between topics)
    ll = (2 * t * z @ table.T - t * t * np.sum(table * table, -1)) / (2 * var)  # [L, V]
    per_pos = logsumexp(ll[:, None, :] + np.asarray(log_unigrams)[None], axis=-1)  # [L, K]
    per_pos = per_pos * np.asarray(mask, np.float64)[:, None]
    loo = per_pos.sum(0)[None] - per_pos
    return np.exp(loo - logsumexp(loo, axis=-1, keepdims=True))


def topic_knowledge(out: str, ar_dir: str, relf_dirs: Sequence[str], n: int = 64, seed: int = 11,
                    times: Sequence[float] = (0.5, 0.8, 0.9, 1.0), unigram_rows: int = 400) -> dict:
    """Whether each model's word distribution knows the conversation's topic (`true_topic_share`
    at the positions whose word is a topic word's first piece, pieces shared by topics left out),
    on `n` conversations drawn from the synthetic grammar (`seed`), one per row: AR's next-word
    distribution p(x_i | x_<i), and each ReLF model's context classifier p(x_i | Z_{-i}) with its
    neighbours noised at each of `times` (1.0: clean), without self-conditioning. Next to each
    classifier row, what `bag_of_tokens_topic_posterior` reads from the same Z at the same
    positions (`topic_argmax_right` compares the two; the topics' token frequencies from
    `unigram_rows` sampled conversations per topic): how much of the topic the noised neighbours
    hold, at the least."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from relf_jax.data.synthetic_chat import SyntheticChat
    from relf_jax.data.synthetic_chat.lexicon import TOPICS
    from relf_jax.eval.metrics import true_topic_share
    from relf_jax.flow.generate import flow_table
    from relf_jax.flow.singular import network_residual

    ar = load_model(ar_dir, "ar")
    tok, length = ar.tokenizer, ar.cfg.data.seq_len
    owners: dict[int, set] = {}
    for k, lists in enumerate(TOPICS.values()):
        for w in (w for words in lists for w in words):
            ids = list(tok.encode(w))
            if ids:
                owners.setdefault(ids[0], set()).add(k)
    topic_of_id = np.full(tok.vocab_size, -1)
    for i, ks in owners.items():
        if len(ks) == 1:
            topic_of_id[i] = next(iter(ks))

    def ids_of(text):
        return [tok.bos_id, *list(tok.encode(text))[:length - 2], tok.eos_id]

    rows = np.full((n, length), tok.pad_id, np.int32)
    seg = np.zeros((n, length), np.int32)
    chats = SyntheticChat().sample_with_info(n, seed)
    for r, chat in enumerate(chats):
        ids = ids_of(chat["text"])
        rows[r, :len(ids)], seg[r, :len(ids)] = ids, 1
    topic = np.array([chat["topic"] for chat in chats])
    counts = np.full((len(TOPICS), tok.vocab_size), 0.1)  # the reader's p(w | k), smoothed
    for k in range(len(TOPICS)):
        for text in SyntheticChat().sample(unigram_rows, seed + 1 + k, topics=[k]):
            np.add.at(counts[k], ids_of(text), 1)
    log_unigrams = np.log(counts / counts.sum(-1, keepdims=True))
    row_at, pos_at = np.nonzero((topic_of_id[rows] >= 0) & (seg != 0))  # the topic words' positions
    report = {"ar_dir": ar_dir, "num_conversations": n, "seed": seed, "rows": []}

    def add(name, probs, targets, text_mask):
        share, right = true_topic_share(probs[text_mask], targets[text_mask], topic_of_id, len(TOPICS))
        report["rows"].append({"model": name, "true_topic_share": share, "topic_argmax_right": right,
                               "chance": 1 / len(TOPICS)})
        print(f"[topic knowledge] {name:>48}: true-topic share {share:.3f}, argmax topic right {right:.3f}",
              flush=True)

    logits = nnx.merge(ar.graphdef, ar.params)(jnp.asarray(rows))
    logits = logits[0] if isinstance(logits, tuple) else logits
    probs = np.asarray(jax.nn.softmax(jnp.asarray(logits, jnp.float32), -1))
    add("ar p(x_i | x_<i)", probs[:, :-1], rows[:, 1:], seg[:, 1:] != 0)
    for relf_dir in relf_dirs:
        lm = load_model(relf_dir, "relf")
        if lm.tokenizer.to_bytes() != tok.to_bytes():
            raise UserError(f"{relf_dir} has another tokenizer than {ar_dir}: the rows would not be its words")
        table = jnp.asarray(flow_table(lm), jnp.float32)
        model, c = nnx.merge(lm.graphdef, lm.params), lm.cfg.flow.residual_bound
        x1 = table[jnp.asarray(rows)]
        for t in times:
            z = t * x1 + (1 - t) * jax.random.normal(jax.random.key(seed), x1.shape)
            f = network_residual(model, z, jnp.zeros_like(z), jnp.full((n,), t, jnp.float32), None,
                                 jnp.asarray(seg), table)
            probs = np.asarray(jax.nn.softmax(c * jnp.tanh(f / c), -1))
            add(f"{relf_dir} p(x_i | Z_-i), t = {t:g}", probs, rows, seg != 0)
            post = np.stack([bag_of_tokens_topic_posterior(np.asarray(z[r]), t, table, log_unigrams, seg[r] != 0)
                             for r in range(n)])[row_at, pos_at]  # [positions, K]
            name, true = f"bag-of-tokens reader on {relf_dir}'s Z, t = {t:g}", topic[row_at]
            on_true = float(post[np.arange(len(true)), true].mean()) if len(true) else float("nan")
            right = float(np.mean(post.argmax(-1) == true)) if len(true) else float("nan")
            report["rows"].append({"model": name, "posterior_on_true_topic": on_true, "topic_argmax_right": right,
                                   "chance": 1 / len(TOPICS)})
            print(f"[topic knowledge] {name:>48}: posterior on the true topic {on_true:.3f}, argmax topic right "
                  f"{right:.3f}", flush=True)
    write_json(out, report)
    return report
