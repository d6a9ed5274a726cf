"""`relf-jax demo`: train the `cpu` AR model (plus a distilled draft, an RCSD-trained copy of
it, a ReLF flow model and a block-diffusion model) on the built-in corpus, sample (AR,
speculative with the draft and with the corpus n-gram table, ReLF, block diffusion), measure,
report.

Composition only: every step is a `relf_jax.workflows` call a Colab user can make too. Writes
``report.json``, ``report.md`` and PNG plots into the workdir; a second run reuses the data,
tokenizer and trained checkpoint it finds there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional, Sequence

from relf_jax import workflows
from relf_jax.config import SpeculativeConfig, make_config
from relf_jax.eval.baselines import positional_unigram_samples
from relf_jax.train.metrics import read_metrics

AR_TEMPERATURES = (1.0, 0.8)
RELF_REFLOW_PAIRS = 64


def _relf_row(lm, judge, n: int, label: str, *, nfe: int, sampler: str) -> dict:
    s = workflows.sample_relf(lm, n, nfe=nfe, sampler=sampler)
    q = workflows.evaluate_samples(s, judge)
    return {"method": label, "nfe": nfe, "gen_ppl": q["gen_ppl"], "entropy": q["entropy"],
            "tokens_per_s": q["tokens_per_s"], "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]}


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
    ids = [workflows.encode_prompt(lm.tokenizer, t) for t in texts]
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
    result = workflows.train_lm(cfg)
    lm = workflows.load_model(cfg.workdir, "ar")
    judge = workflows.exact_judge(cfg)
    sc = cfg.sample

    rows = []
    ref = workflows.data_reference(cfg, lm.tokenizer, judge, n=sc.num_samples, max_tokens=sc.max_new_tokens)
    rows.append({"method": "data", "nfe": None, "gen_ppl": ref["gen_ppl"], "entropy": ref["entropy"],
                 "tokens_per_s": None, "distinct_2": ref["distinct_2"], "mean_tokens": ref["mean_tokens"]})
    for temperature in AR_TEMPERATURES:
        s = workflows.sample(lm, sample_cfg=dataclasses.replace(sc, temperature=temperature))
        q = workflows.evaluate_samples(s, judge)
        rows.append({"method": f"ar T={temperature:g}", "nfe": round(s.tokens / len(s.texts), 1),
                     "gen_ppl": q["gen_ppl"], "entropy": q["entropy"], "tokens_per_s": q["tokens_per_s"],
                     "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]})
        if temperature == 1.0:
            examples = s.texts[:3]

    # speculative decoding with a distilled draft (trained once, cached in <workdir>/draft)
    workflows.train_draft(cfg.workdir, [f"train.steps={max(1, cfg.train.steps // 2)}"])
    draft = workflows.load_model(os.path.join(cfg.workdir, "draft"), "ar")
    # ... and NSD with the corpus n-gram table (no draft network: next-token counts of the data)
    for rule, proposer in (("standard", "draft"), ("nsd", "draft"), ("nsd", "corpus_ngram")):
        spc = SpeculativeConfig(rule=rule, k=4, nsd_top_p=0.9, proposer=proposer)
        s = workflows.sample(lm, sample_cfg=dataclasses.replace(sc, temperature=1.0), speculative=spc,
                             draft=draft if proposer == "draft" else None)
        q = workflows.evaluate_samples(s, judge)
        rows.append({"method": f"spec {rule}" + (" p=0.9" if rule == "nsd" else "") + " k=4"
                     + (" corpus n-gram" if proposer == "corpus_ngram" else ""),
                     "nfe": round(s.target_forwards / len(s.texts), 1), "gen_ppl": q["gen_ppl"],
                     "entropy": q["entropy"], "tokens_per_s": q["tokens_per_s"], "tau": s.tau,
                     "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]})

    # NSD with a draft that kept learning from its own traces (RCSD), starting from the one above
    rcsd_draft = _rcsd_draft(lm, draft, judge, os.path.join(cfg.workdir, "rcsd"), quick=quick)
    spc = SpeculativeConfig(rule="nsd", k=4, nsd_top_p=0.9)
    s = workflows.sample(lm, sample_cfg=dataclasses.replace(sc, temperature=1.0), speculative=spc, draft=rcsd_draft)
    q = workflows.evaluate_samples(s, judge)
    rows.append({"method": "spec nsd p=0.9 k=4 rcsd draft", "nfe": round(s.target_forwards / len(s.texts), 1),
                 "gen_ppl": q["gen_ppl"], "entropy": q["entropy"], "tokens_per_s": q["tokens_per_s"],
                 "tau": s.tau, "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]})

    # ReLF: a flow model of the same width and depth, then two short regularised reflow rounds.
    # A fifth of the AR training budget keeps the demo within its 10 minutes; `relf-jax bench
    # relf` compares at equal budgets.
    relf_steps = max(1, cfg.train.steps // 5)
    workflows.train_lm(make_config(preset, [*overrides, "model=relf", f"train.steps={relf_steps}"], workdir=workdir))
    relf = workflows.load_model(os.path.join(cfg.workdir, "relf"), "relf")
    rows.append(_relf_row(relf, judge, sc.num_samples, "relf stochastic", nfe=64, sampler="stochastic"))
    rows.append(_relf_row(relf, judge, sc.num_samples, "relf euler", nfe=16, sampler="euler"))
    workflows.reflow(cfg.workdir, rounds=2, num_pairs=RELF_REFLOW_PAIRS, rollout_nfe=16,
                     steps=max(1, relf_steps // 8))
    reflowed = workflows.load_model(os.path.join(cfg.workdir, "relf_reflow2"), "relf")
    rows.append(_relf_row(reflowed, judge, sc.num_samples, "relf euler reflow2", nfe=16, sampler="euler"))
    # the reference a whole-sequence model must beat: every position drawn from its own unigram
    # frequencies (a flow model stuck at the positional prior scores like this row)
    s = positional_unigram_samples(workflows.prepare_data(cfg), relf.tokenizer, sc.num_samples, cfg.data.seq_len)
    q = workflows.evaluate_samples(s, judge)
    rows.append({"method": "positional unigram (reference)", "nfe": None, "gen_ppl": q["gen_ppl"],
                 "entropy": q["entropy"], "tokens_per_s": None, "distinct_2": q["distinct_2"],
                 "mean_tokens": q["mean_tokens"]})

    # block diffusion: same width and depth, a quarter of the AR budget (each step trains on
    # noisy + clean copies, about twice an AR step); confidence-threshold decoding, threshold
    # 0.95, tokens sampled at the sample temperature (greedy unconditional samples collapse)
    bd_steps = max(1, cfg.train.steps // 4)
    workflows.train_lm(make_config(preset, [*overrides, "model=bd", f"train.steps={bd_steps}"], workdir=workdir))
    bd = workflows.load_model(cfg.workdir, "bd")
    s = workflows.sample_bd(bd, n=sc.num_samples)
    q = workflows.evaluate_samples(s, judge)
    rows.append({"method": f"block diffusion d={bd.model_cfg.block_size} thr={sc.threshold:g}",
                 "nfe": round(s.target_forwards / len(s.texts), 1), "gen_ppl": q["gen_ppl"],
                 "entropy": q["entropy"], "tokens_per_s": q["tokens_per_s"], "tau": s.tau,
                 "distinct_2": q["distinct_2"], "mean_tokens": q["mean_tokens"]})

    decode = {}
    for batch in (1, 8):
        # several batches, so the figure is not one short, noisy timing
        s = workflows.sample(lm, n=4 * batch, sample_cfg=dataclasses.replace(
            sc, batch_size=batch, num_samples=4 * batch, temperature=1.0))
        decode[str(batch)] = s.tokens_per_s

    train_rows = [r for r in read_metrics(os.path.join(result.workdir, "metrics.jsonl")) if "tokens_per_s" in r]
    report = {
        "preset": preset,
        "rows": rows,
        "train": {"steps": result.step, "final_loss": result.loss, "eval_loss": result.eval_loss,
                  "tokens_per_s": train_rows[-1]["tokens_per_s"] if train_rows else None,
                  "resumed_from": result.resumed_from},
        "decode_tokens_per_s": decode,
        "judge": "exact synthetic_chat likelihood (words)",
        "examples": examples,
        "wall_s": time.perf_counter() - t_start,
    }
    out = os.path.abspath(cfg.workdir)
    workflows.write_json(os.path.join(out, "report.json"), report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(render_markdown(report))
    plot_quality(rows, os.path.join(out, "quality.png"))
    print(render_table(rows))
    print(f"[demo] train tokens/s {_fmt(report['train']['tokens_per_s'])}, decode tokens/s batch 1 "
          f"{_fmt(decode['1'])}, batch 8 {_fmt(decode['8'])}; wall {report['wall_s']:.1f} s")
    print(f"[demo] wrote {out}/report.json, report.md, quality.png, ar/loss_curve.png")
    return report


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return str(v)


COLUMNS = ("method", "nfe", "gen_ppl", "entropy", "tokens_per_s")


def render_table(rows: list[dict]) -> str:
    cells = [[_fmt(r.get(c), 2 if c in ("gen_ppl", "entropy") else 1) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def render_markdown(report: dict) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    body = "".join("| " + " | ".join(_fmt(r.get(c), 2 if c in ("gen_ppl", "entropy") else 1) for c in COLUMNS)
                   + " |\n" for r in report["rows"])
    t = report["train"]
    ex = "\n".join(f"- `{e[:300]}`" for e in report["examples"])
    return (f"# relf-jax demo ({report['preset']})\n\nQuality is a pair: generative perplexity under the "
            f"{report['judge']} and mean per-sample unigram entropy (nats). NFE = target forward passes per "
            f"sample (AR: one per token; speculative: one per draft/verify round; ReLF: network calls for the "
            f"whole sequence, trained on a fifth of the AR budget; block diffusion: denoising steps plus one "
            f"cache refresh per block, trained on a quarter of the AR budget).\n\n"
            f"{head}{body}\nTraining: {t['steps']} steps, final loss {_fmt(t['final_loss'], 3)}, eval loss "
            f"{_fmt(t['eval_loss'], 3)}, {_fmt(t['tokens_per_s'])} tokens/s.\n\nDecode tokens/s: batch 1 "
            f"{_fmt(report['decode_tokens_per_s']['1'])}, batch 8 {_fmt(report['decode_tokens_per_s']['8'])}.\n\n"
            f"Samples (AR, T=1):\n{ex}\n\nWall time: {report['wall_s']:.1f} s.\n")


def plot_quality(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    for r in rows:
        ax.scatter(r["entropy"], r["gen_ppl"], s=40)
        ax.annotate(r["method"], (r["entropy"], r["gen_ppl"]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("mean unigram entropy (nats)")
    ax.set_ylabel("gen PPL (exact judge)")
    ax.set_title("sample quality: lower-right is better")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
