"""`relf-jax demo`: train the `cpu` AR model (plus a distilled draft, an RCSD-trained copy of
it, a ReLF flow model and a block-diffusion model) on the built-in corpus, sample (AR,
speculative with the draft and with the corpus n-gram table, ReLF, block diffusion), measure,
report.

Composition only: every step is a library call a Colab user can make too. Writes
``report.json``, ``report.md`` and PNG plots into the workdir; a second run reuses the data,
tokenizer and trained checkpoint it finds there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

import relf_jax as rj
from relf_jax.config import make_config
from relf_jax.data.prepare import prepare_data
from relf_jax.data.tokenizer import encode_prompt
from relf_jax.eval.baselines import positional_unigram_samples
from relf_jax.eval.evaluate import data_reference, evaluate_samples, exact_judge
from relf_jax.flow.generate import sample_relf
from relf_jax.flow.recipes import reflow
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.methods import DraftModel, NgramTable, Speculative
from relf_jax.sampling.recipes import sample_bd
from relf_jax.speculative.cost import decode_regime
from relf_jax.speculative.recipes import sample, train_draft
from relf_jax.train.metrics import read_metrics

AR_TEMPERATURES = (1.0, 0.8)
RELF_REFLOW_PAIRS = 64
UNIGRAM_REFERENCE = "positional unigram (reference)"


def _row(method: str, nfe, q: dict, *, tokens_per_s="quality", **extra) -> dict:
    """One table row from a quality report `q` (`evaluate_samples`); `extra` (e.g. tau)
    goes after tokens/s."""
    return {"method": method, "nfe": nfe, "gen_ppl": q["gen_ppl"], "entropy": q["entropy"],
            "pooled_entropy": q.get("pooled_entropy"),
            "tokens_per_s": q["tokens_per_s"] if tokens_per_s == "quality" else tokens_per_s, **extra,
            "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]}


def _relf_row(lm, judge, n: int, label: str, *, nfe: int, sampler: str) -> dict:
    s = sample_relf(lm, n, nfe=nfe, sampler=sampler)
    return _row(label, nfe, evaluate_samples(s, judge))


RCSD_CYCLES, RCSD_PROMPTS, RCSD_STEPS = 4, 16, 15


def _rcsd_draft(lm, draft, judge, workdir: str, *, quick: bool):
    """A few serve-and-learn RCSD cycles (NSD serving) on fresh grammar prompts; the result is
    cached in `workdir` (the loop resumes, so a second demo run only reloads it)."""
    from relf_jax.speculative.continual import ContinualDraftTrainer, ContinualSettings

    cycles = 2 if quick else RCSD_CYCLES
    k, context = 4, min(lm.model_cfg.max_seq_len, draft.model_cfg.max_seq_len)
    prompt_len = min(32, context // 4)
    settings = ContinualSettings(steps_per_cycle=RCSD_STEPS, rule="nsd", k=k, prompt_len=prompt_len,
                                 max_new_tokens=min(48, context - prompt_len - k - 1), batch_size=8,
                                 learning_rate=1e-3)
    texts = [info["prompt"] for info in judge.grammar.sample_with_info(cycles * RCSD_PROMPTS, 31337)]
    ids = [encode_prompt(lm.tokenizer, t) for t in texts]
    trainer = ContinualDraftTrainer(lm, draft, workdir, settings)
    trainer.run([ids[c * RCSD_PROMPTS:(c + 1) * RCSD_PROMPTS] for c in range(cycles)])
    return dataclasses.replace(draft, params=trainer.params)


def run_demo(quick: bool = False, workdir: Optional[str] = None, overrides: Sequence[str] = ()) -> dict:
    """Run the demo; returns the report dict (also written to ``<workdir>/report.json``)."""
    preset = "tiny" if quick else "cpu"
    workdir = workdir or os.path.join("runs", f"demo_{preset}")
    cfg = make_config(preset, list(overrides), workdir=workdir)
    t_start = time.perf_counter()

    print(f"[demo] preset={preset} workdir={os.path.abspath(workdir)}")
    result = rj.train(cfg)
    lm = load_model(cfg.workdir, "ar")
    judge = exact_judge(cfg)
    sc = cfg.sample
    ref = data_reference(cfg, lm.tokenizer, judge, n=sc.num_samples, max_tokens=sc.max_new_tokens)
    rows = [_row("data", None, ref, tokens_per_s=None)]
    ar_rows, examples = _ar_rows(lm, judge, sc)
    rows += ar_rows
    rows += _speculative_rows(cfg, lm, judge, quick=quick)
    # the regime the speculative rows ran in: what K + 1 tokens cost against one on this machine
    regime = decode_regime(lm, k=4)
    print(f"[demo] speculative rows' regime: {regime_sentence(regime, rows)}", flush=True)
    rows += _relf_rows(cfg, preset, overrides, judge)
    rows.append(_bd_row(cfg, preset, overrides, judge))
    decode = {}
    for batch in (1, 8):
        # several batches, so the figure is not one short, noisy timing
        s = sample(lm, n=4 * batch, sample_cfg=dataclasses.replace(
            sc, batch_size=batch, num_samples=4 * batch, temperature=1.0))
        decode[str(batch)] = s.tokens_per_s

    versus_unigram = over_positional_unigram(rows)
    print("[demo] whole-sequence rows' gen PPL over the positional-unigram reference (< 1 beats it): "
          + ", ".join(f"{m} x{v:.3f}" for m, v in versus_unigram.items()), flush=True)

    train_rows = [r for r in read_metrics(os.path.join(result.workdir, "metrics.jsonl")) if "tokens_per_s" in r]
    report = {
        "preset": preset,
        "rows": rows,
        "train": {"steps": result.step, "final_loss": result.loss, "eval_loss": result.eval_loss,
                  "tokens_per_s": train_rows[-1]["tokens_per_s"] if train_rows else None,
                  "resumed_from": result.resumed_from},
        "decode_tokens_per_s": decode,
        "speculative_regime": regime,
        "over_positional_unigram": versus_unigram,
        "judge": "exact synthetic_chat likelihood (words)",
        "examples": examples,
        "wall_s": time.perf_counter() - t_start,
    }
    _write_report(report, os.path.abspath(cfg.workdir))
    return report


def over_positional_unigram(rows: list[dict]) -> dict:
    """Each ReLF and block-diffusion row's gen PPL over the positional-unigram reference row's: a
    whole-sequence model at or above 1 has learned nothing beyond per-position frequencies."""
    uni = next(r for r in rows if r["method"] == UNIGRAM_REFERENCE)
    return {r["method"]: r["gen_ppl"] / uni["gen_ppl"] for r in rows
            if r["method"].startswith(("relf", "block diffusion"))}


def _ar_rows(lm, judge, sc) -> tuple[list[dict], list[str]]:
    """AR at each of `AR_TEMPERATURES`, and three samples at T = 1."""
    rows = []
    for temperature in AR_TEMPERATURES:
        s = sample(lm, sample_cfg=dataclasses.replace(sc, temperature=temperature))
        rows.append(_row(f"ar T={temperature:g}", round(s.tokens / len(s.texts), 1),
                         evaluate_samples(s, judge)))
        if temperature == 1.0:
            examples = s.texts[:3]
    return rows, examples


def _speculative_rows(cfg, lm, judge, *, quick: bool) -> list[dict]:
    """Speculative decoding with a distilled draft (trained once, cached in <workdir>/draft), NSD
    with the corpus n-gram table (no draft network: next-token counts of the data), and NSD with a
    draft that kept learning from its own traces (RCSD), starting from the distilled one."""
    sc = dataclasses.replace(cfg.sample, temperature=1.0)
    train_draft(cfg.workdir, [f"train.steps={max(1, cfg.train.steps // 2)}"])
    draft = load_model(os.path.join(cfg.workdir, "draft"), "ar")
    rows = []
    for rule, proposer in (("standard", DraftModel(draft)), ("nsd", DraftModel(draft)), ("nsd", NgramTable())):
        s = sample(lm, sample_cfg=sc, method=Speculative(rule=rule, k=4, nsd_top_p=0.9, proposer=proposer))
        rows.append(_row(f"spec {rule}" + (" p=0.9" if rule == "nsd" else "") + " k=4"
                         + (" corpus n-gram" if isinstance(proposer, NgramTable) else ""),
                         round(s.target_forwards / len(s.texts), 1), evaluate_samples(s, judge), tau=s.tau))
    rcsd_draft = _rcsd_draft(lm, draft, judge, os.path.join(cfg.workdir, "rcsd"), quick=quick)
    s = sample(lm, sample_cfg=sc, method=Speculative(rule="nsd", k=4, nsd_top_p=0.9, proposer=DraftModel(rcsd_draft)))
    rows.append(_row("spec nsd p=0.9 k=4 rcsd draft", round(s.target_forwards / len(s.texts), 1),
                     evaluate_samples(s, judge), tau=s.tau))
    return rows


def _relf_rows(cfg, preset: str, overrides: Sequence[str], judge) -> list[dict]:
    """ReLF: a flow model of the same width and depth, then two short regularised reflow rounds,
    and the positional-unigram reference. A fifth of the AR training budget keeps the demo within
    its 10 minutes; `relf-jax bench relf` compares at equal budgets."""
    n = cfg.sample.num_samples
    relf_steps = max(1, cfg.train.steps // 5)
    rj.train(make_config(preset, [*overrides, "model=relf", f"train.steps={relf_steps}"],
                                   workdir=cfg.workdir))
    relf = load_model(os.path.join(cfg.workdir, "relf"), "relf")
    rows = [_relf_row(relf, judge, n, "relf stochastic", nfe=64, sampler="stochastic"),
            _relf_row(relf, judge, n, "relf euler", nfe=16, sampler="euler")]
    reflow(cfg.workdir, rounds=2, num_pairs=RELF_REFLOW_PAIRS, rollout_nfe=16,
                     steps=max(1, relf_steps // 8))
    reflowed = load_model(os.path.join(cfg.workdir, "relf_reflow2"), "relf")
    rows.append(_relf_row(reflowed, judge, n, "relf euler reflow2", nfe=16, sampler="euler"))
    # the reference a whole-sequence model must beat: every position drawn from its own unigram
    # frequencies (a flow model stuck at the positional prior scores like this row)
    s = positional_unigram_samples(prepare_data(cfg), relf.tokenizer, n, cfg.data.seq_len)
    rows.append(_row(UNIGRAM_REFERENCE, None, evaluate_samples(s, judge), tokens_per_s=None))
    return rows


def _bd_row(cfg, preset: str, overrides: Sequence[str], judge) -> dict:
    """Block diffusion: same width and depth, a quarter of the AR budget (each step trains on
    noisy + clean copies, about twice an AR step); confidence-threshold decoding, threshold 0.95,
    tokens sampled at the sample temperature (greedy unconditional samples collapse)."""
    bd_steps = max(1, cfg.train.steps // 4)
    rj.train(make_config(preset, [*overrides, "model=bd", f"train.steps={bd_steps}"], workdir=cfg.workdir))
    bd = load_model(cfg.workdir, "bd")
    s = sample_bd(bd, n=cfg.sample.num_samples)
    return _row(f"block diffusion d={bd.model_cfg.block_size} thr={cfg.sample.threshold:g}",
                round(s.target_forwards / len(s.texts), 1), evaluate_samples(s, judge), tau=s.tau)


def _write_report(report: dict, out: str) -> None:
    """report.json, report.md and quality.png in `out`; the table and the speeds on stdout."""
    write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report))
    plot_quality(report["rows"], os.path.join(out, "quality.png"))
    print(render_table(report["rows"]))
    decode = report["decode_tokens_per_s"]
    print(f"[demo] train tokens/s {_fmt(report['train']['tokens_per_s'])}, decode tokens/s batch 1 "
          f"{_fmt(decode['1'])}, batch 8 {_fmt(decode['8'])}; wall {report['wall_s']:.1f} s")
    print(f"[demo] wrote {out}/report.json, report.md, quality.png, ar/loss_curve.png")


def regime_sentence(regime: dict, rows: list[dict]) -> str:
    """The speculative rows' regime (`relf_jax.speculative.cost.decode_regime`) and each row's
    ceiling at its tau, in one sentence. Weights inside the last-level cache: the step is bound by
    compute and dispatch overhead, not by reading weights from memory (speculation's regime)."""
    spec_rows = [r for r in rows if r["method"].startswith("spec ")]
    cache = ("" if regime["weights_fit_in_cache"] is None else
             f" ({'inside' if regime['weights_fit_in_cache'] else 'past'} the {regime['last_level_cache_bytes'] >> 20}"
             f" MiB {regime['last_level_cache']})")
    ratio = regime["verify_over_one_token"]
    bounds = ", ".join(f"{r['method']} tau {r['tau']:.2f} -> at most x{r['tau'] / ratio:.2f}" for r in spec_rows)
    kind = {None: "cache unknown", True: "in cache: compute/overhead-bound",
            False: "past the cache: memory-bound"}[regime["weights_fit_in_cache"]]
    return (f"the target's {regime['weight_bytes'] / 1e6:.1f} MB of weights{cache}; "
            f"verifying K + 1 = {regime['k'] + 1} tokens costs x{ratio:.2f} a one-token step ({kind}), so a round "
            f"of tau tokens is at most tau / {ratio:.2f} faster than AR: {bounds}. The memory-bound regime: "
            f"`relf-jax bench spec --preset cpu-wide` (docs/speculative.md)")


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


COLUMNS = ("method", "nfe", "gen_ppl", "entropy", "pooled_entropy", "tokens_per_s")
_TWO_DECIMALS = ("gen_ppl", "entropy", "pooled_entropy")


def render_table(rows: list[dict]) -> str:
    cells = [[_fmt(r.get(c), 2 if c in _TWO_DECIMALS else 1) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c), 2 if c in _TWO_DECIMALS else 1) for c in COLUMNS)
                   + " |\n" for r in report["rows"])
    t = report["train"]
    ex = "\n".join(f"- `{e[:300]}`" for e in report["examples"])
    return (f"# relf-jax demo ({report['preset']})\n\nQuality is a pair: generative perplexity under the "
            f"{report['judge']} and mean per-sample unigram entropy (nats; it grows with sample length, so the "
            f"pooled entropy of all samples' words is shown next to it, docs/relf.md). NFE = target forward passes per "
            f"sample (AR: one per token; speculative: one per draft/verify round; ReLF: network calls for the "
            f"whole sequence, trained on a fifth of the AR budget; block diffusion: denoising steps plus one "
            f"cache refresh per block, trained on a quarter of the AR budget).\n\n"
            f"{head}{body}\nTraining: {t['steps']} steps, final loss {_fmt(t['final_loss'], 3)}, eval loss "
            f"{_fmt(t['eval_loss'], 3)}, {_fmt(t['tokens_per_s'])} tokens/s.\n\nDecode tokens/s: batch 1 "
            f"{_fmt(report['decode_tokens_per_s']['1'])}, batch 8 {_fmt(report['decode_tokens_per_s']['8'])}.\n\n"
            f"{_regime_md(report)}{_unigram_md(report)}Samples (AR, T=1):\n{ex}\n\n"
            f"Wall time: {report['wall_s']:.1f} s.\n")


def _regime_md(report: dict) -> str:
    regime = report.get("speculative_regime")
    if regime is None:
        return ""
    return f"Speculative rows: {regime_sentence(regime, report['rows'])}.\n\n"


def _unigram_md(report: dict) -> str:
    versus = report.get("over_positional_unigram")
    if not versus:
        return ""
    return ("Whole-sequence rows against the positional-unigram reference (gen PPL ratio; below 1 beats it, at "
            "1 the model has learned only per-position frequencies): "
            + ", ".join(f"{m} x{v:.3f}" for m, v in versus.items()) + ". Equal-budget comparisons: "
            "`relf-jax bench relf --parts core` (docs/relf.md) and `relf-jax bench bd` (docs/block_diffusion.md).\n\n")


def plot_quality(rows: list[dict], path: str) -> None:
    """Gen PPL (log scale) against entropy, one marker per row named in the legend (no inline labels:
    the rows crowd); the positional-unigram reference as a dashed line at its gen PPL, which a
    whole-sequence model must get below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = "o^sDvP<>Xhp8d"
    colors = [c for j, c in enumerate(plt.get_cmap("tab10").colors) if j != 7]  # grey marks the reference
    fig, ax = plt.subplots(figsize=(9, 4.8), layout="constrained")
    shown = [r for r in rows if r.get("gen_ppl") is not None and r.get("entropy") is not None]
    for i, r in enumerate(shown):
        if r["method"] == UNIGRAM_REFERENCE:
            ax.axhline(r["gen_ppl"], color="0.4", ls="--", lw=1, zorder=1)
            ax.scatter(r["entropy"], r["gen_ppl"], marker="x", color="0.4", s=60, zorder=3,
                       label=f"{r['method']}: gen PPL {r['gen_ppl']:,.0f} (dashed line)")
        elif r["method"] == "data":
            ax.scatter(r["entropy"], r["gen_ppl"], marker="*", color="black", s=120, zorder=3,
                       label="data (held-out conversations)")
        else:
            ax.scatter(r["entropy"], r["gen_ppl"], marker=markers[i % len(markers)], color=colors[i % len(colors)],
                       s=45, zorder=3, label=r["method"])
    ax.set_yscale("log")
    ax.margins(x=0.06, y=0.08)
    ax.set_xlabel("mean unigram entropy (nats)")
    ax.set_ylabel("gen PPL (exact judge, log scale)")
    ax.set_title("sample quality: lower is better at equal entropy")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
