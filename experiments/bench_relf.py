"""`relf-jax bench relf`: ReLF vs AR on `synthetic_chat` under the exact judge, in one run.

Composition only (every step is a `relf_jax.workflows` call). For each of two training
budgets (``train.steps`` and half of it; the same number of training rows of ``seq_len``
tokens for AR and ReLF) it trains an AR and a ReLF model of the same size and samples whole
conversations (unconditional, up to ``seq_len`` tokens) from both:

- AR: a temperature sweep, the quality curve that ReLF rows are compared against at
  matched entropy (gen PPL of AR interpolated, in log space, at the ReLF row's entropy);
- ReLF: 64-NFE stochastic and 8 / 16 / 32-NFE Euler, before reflow and (full budget) after
  each of two regularised reflow rounds; the two stochastic renoise rules side by side;
- ablations at 64 NFE: singular logits off, Gaussian embeddings and the MSE velocity loss
  (each trained at the smaller budget and compared with that budget's ReLF, to save CPU time),
  and a guidance-scale sweep (1, 1.3, 1.7, 2.5) on the full-budget model;
- our extensions (`EXTENSIONS`, full budget, 64-NFE stochastic and 16-NFE Euler): the
  auxiliary singular-free head (``flow.aux_weight=1``, variant ``aux_head``), a time per
  position in half the training rows (``flow.per_position_t=0.5``), both, and the paper's plain
  network (``flow.blind_spot=false``, variant ``plain``; the ``relf`` rows are the default,
  context-reading network since issue 35). The plain model (`REFLOW_EXTENSIONS`) also gets the
  8 / 32-NFE Euler rows and two reflow rounds with the same rows after each, and the reflow
  targets are restated for it (``plain_...``);
- a no-pairs control for each reflow study (`NO_PAIRS`, variant ``<model>_nopairs``): two rounds
  with the same schedule, steps and batches but the data loss only, so that what reflow gains
  over training as long is told apart (``*reflow2_vs_nopairs_control``);
- latency of one sequence of ``seq_len`` tokens at batch 1 and 64: AR with its KV cache vs
  ReLF at 16 NFE, and their ratio;
- straightness of each reflow round's coupling before and after training on it;
- a reference row with no model at all: every position drawn independently from the training
  documents' token frequencies at that position (`positional_unigram_samples`). A flow model
  whose samples score no better has learned nothing beyond per-position statistics;
- prompted replies (`prompted_rows`, full budget): the reply to held-out first user turns,
  scored given the prompt under the exact judge, for AR, the ReLF model with its prompt
  renoised, and a ReLF model trained with clean prompts (``flow.prompt_prob``) sampled with the
  prompt held clean; that model's unconditional rows too (variant ``prompt_training``).

Rows carry ``method, nfe, reflow_rounds, gen_ppl, entropy, latency_s, batch`` (+ the budget
and variant), each over `num_samples` samples; ``targets`` restates the issue's targets as
measured ratios. ``--parts`` picks "models", "reflow" and "latency" (`PARTS`); ``--parts reflow``
trains only the full-budget plain and `REFLOW_EXTENSIONS` models and runs their reflow studies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Sequence

import numpy as np

from experiments.bench import _find as _pick
from experiments.bench import _write_json
from relf_jax.config import make_config

AR_TEMPERATURES = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
QUICK_AR_TEMPERATURES = (0.7, 0.85, 1.0)
EULER_NFES = (8, 16, 32)
GUIDANCE = (1.0, 1.3, 1.7, 2.5)
PROMPT_TRAINING = ["flow.prompt_prob=0.5"]
ABLATIONS = {"no_singular": ["flow.use_singular=false"], "gaussian_embeddings": ["flow.embeddings=gaussian"],
             "mse_loss": ["flow.loss=mse"]}
# our extensions to the paper's training, trained at the full budget, against the plain ReLF rows
EXTENSIONS = {"aux_head": ["flow.aux_weight=1"], "per_position_t": ["flow.per_position_t=0.5"],
              "aux_head_per_position_t": ["flow.aux_weight=1", "flow.per_position_t=0.5"],
              "plain": ["flow.blind_spot=false"]}
# extensions that also get two reflow rounds (and the 8 / 16 / 32-NFE Euler rows before and after);
# since issue 35 the "relf" rows are the context-reading default and "plain" is the paper's network
REFLOW_EXTENSIONS = ("plain",)


PARTS = ("models", "reflow", "latency", "core")
# the no-pairs control of a reflow study: the same rounds, schedule and batches, data loss only
NO_PAIRS = {"pair_weight": 0.0, "data_weight": 1.0}


def bench_relf(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
               parts: Sequence[str] = PARTS) -> dict:
    """Runs the parts named in `parts`: "models" (the AR sweep, ReLF rows at both budgets,
    ablations, guidance, extensions, prompted replies, the unigram reference), "reflow" (two
    reflow rounds and two no-pairs control rounds of the plain and `REFLOW_EXTENSIONS` models,
    with rows before and after each) and "latency"; those three by default. "core" alone
    (`bench_relf_core`) is the issue-35 comparison at one budget: the unigram reference, the AR
    sweep, the default ReLF and the paper's plain parametrisation, with text tokens per step."""
    from relf_jax import workflows
    from relf_jax.errors import UserError
    from relf_jax.flow.reflow import DATA_WEIGHT

    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts or ("core" in parts and len(parts) > 1):
        raise UserError(f"bench relf parts must be a non-empty subset of {', '.join(PARTS[:3])}, or core alone; "
                        f"got {list(parts)}")
    if "core" in parts:
        return bench_relf_core(out, quick=quick, workdir=workdir, overrides=overrides)
    preset = "tiny" if quick else "cpu"
    root = os.path.abspath(workdir or os.path.join("runs", f"bench_relf_{preset}"))
    base = make_config(preset, list(overrides), workdir=os.path.join(root, "shared"))
    # one data set and tokenizer for every model of the run
    builder = workflows.prepare_data(base)
    tok = workflows.prepare_tokenizer(base, builder)
    judge = workflows.exact_judge(base)
    # samples per row: at 64, four seeds of one row (the blind-spot model, 8-NFE Euler) gave gen
    # PPL 473-559, too wide for the 20 % reflow target; at 256 two seeds gave 523 and 526
    n = 32 if quick else 256
    temps = QUICK_AR_TEMPERATURES if quick else AR_TEMPERATURES
    full = base.train.steps
    models = "models" in parts
    budgets = (full, max(1, full // 2)) if models else (full,)
    pairs, reflow_steps = (64 if quick else 512), max(1, full // 2)
    t0 = time.perf_counter()
    rows, prompted, straight, latency = [], [], {}, {"rows": [], "ratio": {}}

    def record(row):
        rows.append(row)
        _write_json(out, {"preset": preset, "complete": False, "parts": list(parts), "rows": rows})  # nothing lost
        ppl = "   empty" if row["gen_ppl"] is None else f"{row['gen_ppl']:8.2f}"
        print(f"[bench relf] {row['train_steps']:>5} steps {row['method']:>26} nfe {row['nfe']!s:>4} "
              f"reflow {row['reflow_rounds']}: gen PPL {ppl}  entropy {row['entropy']:.2f}  "
              f"{row['latency_s'] * 1e3:8.1f} ms/batch", flush=True)

    def reflow_study(model_wd, variant):
        """Two reflow rounds and two no-pairs control rounds from the model in `model_wd`/relf."""
        study = {}
        for kind, extra, name in (("pairs", {}, "relf_reflow"), ("nopairs", NO_PAIRS, "relf_nopairs")):
            study[kind] = workflows.reflow(model_wd, rounds=2, num_pairs=pairs, steps=reflow_steps, name=name, **extra)
            for r in (1, 2):
                rlm = workflows.load_model(os.path.join(model_wd, f"{name}{r}"), "relf")
                _relf_rows(record, rlm, judge, n, full, rounds=r, variant=variant if kind == "pairs"
                           else f"{variant}_nopairs", nfes=EULER_NFES if kind == "pairs" else (8, 16))
        return study

    if models:
        uni = positional_unigram_samples(builder, tok, n, base.data.seq_len)
        record(_row(uni, judge, method="positional unigram", nfe=None, reflow_rounds=0, steps=0, variant="reference"))
    for steps in budgets:
        wd = _workdir(root, f"steps{steps}", base)
        cfg = make_config(preset, [*overrides, f"train.steps={steps}"], workdir=wd)
        if models or "latency" in parts:
            workflows.train_lm(cfg)
            ar_lm = workflows.load_model(wd, "ar")
        for temperature in temps if models else ():
            sc = dataclasses.replace(ar_lm.cfg.sample, temperature=temperature, top_k=0, top_p=1.0,
                                     max_new_tokens=cfg.data.seq_len - 1, num_samples=n)
            s = workflows.sample(ar_lm, n=n, sample_cfg=sc)
            record(_row(s, judge, method=f"ar T={temperature:g}", nfe=None, reflow_rounds=0, steps=steps,
                        variant="ar", temperature=temperature, batch=sc.batch_size))
        relf_cfg = make_config(preset, [*overrides, f"train.steps={steps}", "model=relf"], workdir=wd)
        workflows.train_lm(relf_cfg)
        relf_dir = os.path.join(wd, "relf")
        lm = workflows.load_model(relf_dir, "relf")
        if models or "reflow" in parts:
            _relf_rows(record, lm, judge, n, steps, rounds=0, variant="relf", renoise_pair=True)
        if steps != full:
            # ablations at the smaller budget (CPU time), against that budget's ReLF rows
            for name, extra in ABLATIONS.items():
                awd = _workdir(root, f"steps{steps}_{name}", base)
                workflows.train_lm(make_config(preset, [*overrides, f"train.steps={steps}", "model=relf", *extra],
                                               workdir=awd))
                alm = workflows.load_model(os.path.join(awd, "relf"), "relf")
                s = workflows.sample_relf(alm, n, nfe=64, sampler="stochastic")
                record(_row(s, judge, method=f"relf stochastic {name}", nfe=64, reflow_rounds=0, steps=steps,
                            variant=name, batch=alm.cfg.sample.batch_size))
            continue
        if models:
            for g in GUIDANCE[1:]:
                s = workflows.sample_relf(lm, n, nfe=64, sampler="stochastic", guidance=g)
                record(_row(s, judge, method=f"relf stochastic w={g:g}", nfe=64, reflow_rounds=0, steps=steps,
                            variant="guidance", guidance=g, batch=lm.cfg.sample.batch_size))
            pwd = _workdir(root, f"steps{steps}_prompt_training", base)
            workflows.train_lm(make_config(preset, [*overrides, f"train.steps={steps}", "model=relf",
                                                    *PROMPT_TRAINING], workdir=pwd))
            plm = workflows.load_model(os.path.join(pwd, "relf"), "relf")
            s = workflows.sample_relf(plm, n, nfe=64, sampler="stochastic")
            record(_row(s, judge, method="relf stochastic prompt_training", nfe=64, reflow_rounds=0, steps=steps,
                        variant="prompt_training", batch=plm.cfg.sample.batch_size))
        for name, extra in EXTENSIONS.items():
            with_reflow = name in REFLOW_EXTENSIONS and "reflow" in parts
            if not (models or with_reflow):
                continue
            ewd = _workdir(root, f"steps{steps}_{name}", base)
            workflows.train_lm(make_config(preset, [*overrides, f"train.steps={steps}", "model=relf", *extra],
                                           workdir=ewd))
            elm = workflows.load_model(os.path.join(ewd, "relf"), "relf")
            _relf_rows(record, elm, judge, n, steps, rounds=0, variant=name,
                       nfes=EULER_NFES if name in REFLOW_EXTENSIONS else (16,))
            if with_reflow:
                straight[name] = reflow_study(ewd, name)
        if models:
            from experiments.bench import held_out_prompts
            prompted = prompted_rows(ar_lm, lm, plm, judge, held_out_prompts(cfg, 16 if quick else 128),
                                     steps=steps)
        if "reflow" in parts:
            straight["relf"] = reflow_study(wd, "relf")
        if "latency" in parts:
            latency = _latency(ar_lm, lm, length=cfg.data.seq_len, batches=(1, 64))

    report = {"preset": preset, "complete": True, "parts": list(parts), "num_samples": n,
              "budgets_steps": list(budgets), "tokens_per_step": base.train.batch_size * base.data.seq_len,
              "reflow": {"rounds": 2, "pairs": pairs, "steps_per_round": reflow_steps, "data_weight": DATA_WEIGHT,
                         "no_pairs": NO_PAIRS},
              "rows": rows, "latency": latency["rows"], "latency_ratio_ar_over_relf16": latency["ratio"],
              "straightness": straight, "prompted": prompted,
              "targets": targets(rows, budgets, prompted),
              "judge": judge.name,
              "wall_s": time.perf_counter() - t0}
    _write_json(out, report)
    print(json.dumps(report["targets"], indent=2))
    print(json.dumps(report["latency_ratio_ar_over_relf16"]))
    return report


def text_tokens_per_step(cfg, builder, tok, rows: str, batches: int = 50) -> float:
    """Mean text (non-pad) tokens a training step of `cfg` sees on `rows`, over `batches` batches:
    what "the same budget" spends on text (AR's packed rows: all of batch x seq_len)."""
    from relf_jax.data import pipeline

    it = pipeline.make_iterator(builder, "train", tok, seq_len=cfg.data.seq_len, batch_size=cfg.train.batch_size,
                                seed=cfg.train.seed, rows=rows)
    text = []
    for _ in range(batches):
        b = next(it)
        seg, toks = b["segment_ids"][:, :-1], b["tokens"][:, :-1]
        keep = seg != 0 if rows != "documents" else toks != tok.pad_id
        text.append(float(keep.sum()))
    return float(np.mean(text))


# the paper's plain parametrisation, the ablation row of the core comparison
PLAIN = ["flow.blind_spot=false"]
# the ReLF models of the core comparison: the default, and variants (overrides) against it
CORE_VARIANTS = {"relf": [], "plain": PLAIN, "whiten": ["flow.embed_whiten=true"]}


def bench_relf_core(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
                    preset: str | None = None, num_samples: int | None = None) -> dict:
    """Issue 35's comparison at one budget (``train.steps``): the positional-unigram reference,
    the AR temperature sweep, the default ReLF (context-reading; 64-NFE stochastic, 16 / 8-NFE
    Euler), the paper's plain parametrisation (64-NFE stochastic) and the other
    `CORE_VARIANTS` (as the default's rows), at the same optimizer
    steps; text tokens per step are measured for each row layout and stated. Targets: the
    default ReLF-64's gen PPL over AR's at matched entropy (<= 1.5, and the paper's <= 1.0)."""
    from relf_jax import workflows

    preset = preset or ("tiny" if quick else "cpu")
    root = os.path.abspath(workdir or os.path.join("runs", f"bench_relf_core_{preset}"))
    base = make_config(preset, list(overrides), workdir=os.path.join(root, "shared"))
    builder = workflows.prepare_data(base)
    tok = workflows.prepare_tokenizer(base, builder)
    judge = workflows.exact_judge(base)
    n = num_samples or (32 if quick else 256)
    steps = base.train.steps
    t0 = time.perf_counter()
    rows = []

    def record(row):
        rows.append(row)
        _write_json(out, {"preset": preset, "complete": False, "parts": ["core"], "rows": rows})
        ppl = "   empty" if row["gen_ppl"] is None else f"{row['gen_ppl']:8.2f}"
        print(f"[bench relf core] {row['train_steps']:>5} steps {row['method']:>32} nfe {row['nfe']!s:>4}: "
              f"gen PPL {ppl}  entropy {row['entropy']:.2f}", flush=True)

    relf_cfg = make_config(preset, [*overrides, "model=relf"], workdir=root)
    tokens = {"ar": float(base.train.batch_size * base.data.seq_len),  # packed: every target is text
              "relf": text_tokens_per_step(relf_cfg, builder, tok, workflows.row_mode(relf_cfg))}
    print(f"[bench relf core] text tokens per step: AR {tokens['ar']:.0f}, ReLF {tokens['relf']:.0f}", flush=True)
    uni = positional_unigram_samples(builder, tok, n, base.data.seq_len)
    record(_row(uni, judge, method="positional unigram", nfe=None, reflow_rounds=0, steps=0, variant="reference"))
    wd = _workdir(root, f"steps{steps}", base)
    workflows.train_lm(make_config(preset, [*overrides], workdir=wd))
    ar_lm = workflows.load_model(wd, "ar")
    for temperature in (QUICK_AR_TEMPERATURES if quick else AR_TEMPERATURES):
        sc = dataclasses.replace(ar_lm.cfg.sample, temperature=temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=base.data.seq_len - 1, num_samples=n)
        s = workflows.sample(ar_lm, n=n, sample_cfg=sc)
        record(_row(s, judge, method=f"ar T={temperature:g}", nfe=None, reflow_rounds=0, steps=steps,
                    variant="ar", temperature=temperature, batch=sc.batch_size, text_tokens_per_step=tokens["ar"]))
    for variant, extra in CORE_VARIANTS.items():
        vwd = _workdir(root, f"steps{steps}_{variant}", base)
        workflows.train_lm(make_config(preset, [*overrides, "model=relf", *extra], workdir=vwd))
        lm = workflows.load_model(os.path.join(vwd, "relf"), "relf")
        runs = [("stochastic", 64)] + ([("euler", 16), ("euler", 8)] if variant != "plain" else [])
        text = tokens["relf"] if variant == "relf" else text_tokens_per_step(
            lm.cfg, builder, tok, workflows.row_mode(lm.cfg))
        for sampler, nfe in runs:
            s = workflows.sample_relf(lm, n, nfe=nfe, sampler=sampler)
            record(_row(s, judge, method=f"relf {sampler}" + ("" if variant == "relf" else f" {variant}"), nfe=nfe,
                        reflow_rounds=0, steps=steps, variant=variant, batch=lm.cfg.sample.batch_size,
                        text_tokens_per_step=text))
    ar_rows = [r for r in rows if r["variant"] == "ar" and r["gen_ppl"]]
    tgt = {"text_tokens_per_step": tokens, "optimizer_steps": steps}
    for r in rows:
        if r["variant"] in CORE_VARIANTS and r["gen_ppl"]:
            ppl, gap = ar_ppl_at_entropy(ar_rows, r["entropy"])
            tgt[f"{r['variant']}_{r['method'].split()[1]}{r['nfe']}_vs_ar_at_matched_entropy"] = {
                "relf_gen_ppl": r["gen_ppl"], "relf_entropy": r["entropy"], "ar_gen_ppl_interpolated": ppl,
                "entropy_outside_ar_sweep_nats": gap, "ratio": _ratio(r["gen_ppl"], ppl),
                "target": "<= 1.5 (paper: <= 1.0)" if r["variant"] == "relf" and r["nfe"] == 64 else None}
    uni_row = rows[0]
    tgt["over_positional_unigram_gen_ppl"] = {r["method"] + f" {r['nfe']}": _ratio(r["gen_ppl"], uni_row["gen_ppl"])
                                              for r in rows if r["variant"] in CORE_VARIANTS}
    report = {"preset": preset, "complete": True, "parts": ["core"], "num_samples": n, "budgets_steps": [steps],
              "tokens_per_step": tokens, "rows": rows, "targets": tgt, "judge": judge.name,
              "wall_s": time.perf_counter() - t0}
    _write_json(out, report)
    print(json.dumps(tgt, indent=2))
    return report


def _workdir(root: str, name: str, base) -> str:
    """A run directory that shares the data and tokenizer prepared in ``base.workdir``."""
    wd = os.path.join(root, name)
    os.makedirs(wd, exist_ok=True)
    data = os.path.join(wd, "data")
    if not os.path.exists(data):
        os.symlink(os.path.join(base.workdir, "data"), data)
    tok = os.path.join(wd, "tokenizer.model")
    if not os.path.exists(tok):
        shutil.copy(os.path.join(base.workdir, "tokenizer.model"), tok)
    return wd


def positional_unigram_samples(builder, tok, n: int, length: int, *, docs: int = 5000, seed: int = 0):
    """`n` rows of `length` tokens, each position drawn independently from the token frequencies
    at that position in (up to `docs`) training documents laid out as ReLF's training rows
    (BOS, the conversation, EOS, then pad), decoded like ReLF samples."""
    import itertools

    from relf_jax import workflows
    from relf_jax.data import sources

    counts = np.zeros((length, tok.vocab_size), np.float64)
    cols = np.arange(length)
    for text in itertools.islice(sources.iter_texts(builder, "train"), docs):
        ids = ([tok.bos_id] + tok.encode(text) + [tok.eos_id] + [tok.pad_id] * length)[:length]
        counts[cols, ids] += 1
    cdf = np.cumsum(counts / counts.sum(1, keepdims=True), axis=1)
    u = np.random.default_rng(seed).random((n, length, 1))
    rows = np.minimum((u > cdf[None]).sum(-1), tok.vocab_size - 1)
    return workflows.samples_from_rows(tok, rows)


def _row(samples, judge, *, method, nfe, reflow_rounds, steps, variant, batch: int = 8, **extra) -> dict:
    """One result row; latency_s is the decode time of one batch of `batch` sequences."""
    from relf_jax import workflows

    q = workflows.evaluate_samples(samples, judge)
    batches = max(1, math.ceil(len(samples.texts) / batch))
    # all-empty samples (a degenerate model) have no gen PPL: null in the JSON, not NaN
    ppl = q["gen_ppl"] if math.isfinite(q["gen_ppl"]) else None
    return {"method": method, "nfe": nfe, "reflow_rounds": reflow_rounds, "gen_ppl": ppl,
            "entropy": q["entropy"], "latency_s": samples.seconds / batches, "batch": batch,
            "train_steps": steps, "variant": variant, "mean_tokens": q["mean_tokens"],
            "distinct_2": q["distinct_2"], **extra}


def prompted_rows(ar_lm, relf_lm, prompt_lm, judge, prompts: Sequence[str], *, steps: int,
                  log=print) -> list[dict]:
    """Replies to `prompts` (texts ending with ``<assistant>``), each cut at the end of its turn
    and scored given its prompt under the exact judge (reply words, scored as a prefix): AR at
    T = 1 and 0.8; `relf_lm` with the prompt renoised; `prompt_lm` (trained with clean prompts)
    with the prompt held clean and, to separate training from sampling, renoised. ReLF at 64-NFE
    stochastic and 16-NFE Euler. Rows: method, nfe, variant, prompt_mode, gen_ppl, entropy,
    reply_words, ended (share of replies that reached the end of their turn)."""
    from relf_jax import workflows
    from relf_jax.eval.metrics import mean_unigram_entropy

    sc = ar_lm.cfg.sample
    longest = max(len(workflows.encode_prompt(ar_lm.tokenizer, p)) for p in prompts)
    room = min(relf_lm.cfg.data.seq_len, ar_lm.model_cfg.max_seq_len) - longest
    runs = [(f"ar T={t:g}", None, "ar", "-", lambda t=t: workflows.sample(
        ar_lm, prompts, sample_cfg=dataclasses.replace(sc, temperature=t, top_k=0, top_p=1.0, max_new_tokens=room)))
        for t in (1.0, 0.8)]
    for label, model, mode in (("relf", relf_lm, "renoise"), ("relf prompt_training", prompt_lm, "clean"),
                               ("relf prompt_training", prompt_lm, "renoise")):
        for sampler, nfe in (("stochastic", 64), ("euler", 16)):
            runs.append((f"{label} {sampler} prompt {mode}", nfe, "relf" if model is relf_lm else "prompt_training",
                         mode, lambda m=model, s=sampler, k=nfe, pm=mode: workflows.sample_relf(
                             m, prompts=prompts, nfe=k, sampler=s, prompt_mode=pm)))
    rows = []
    for method, nfe, variant, mode, run in runs:
        samples = _cut_turns(run(), ar_lm.tokenizer if variant == "ar" else None)
        logp, words = judge.score_replies(list(prompts), samples.texts, [False] * len(prompts))
        row = {"method": method, "nfe": nfe, "variant": variant, "prompt_mode": mode, "train_steps": steps,
               "gen_ppl": float(math.exp(-logp.sum() / max(words.sum(), 1))),
               "entropy": mean_unigram_entropy([t.split() for t in samples.texts]),
               "reply_words": float(np.mean([len(t.split()) for t in samples.texts])),
               "ended": float(np.mean(samples.complete))}
        rows.append(row)
        log(f"[bench relf] prompted {method:>44} nfe {nfe!s:>4}: reply gen PPL {row['gen_ppl']:9.2f}  entropy "
            f"{row['entropy']:.2f}  {row['reply_words']:.1f} words, {row['ended']:.0%} ended", flush=True)
    return rows


def _cut_turns(samples, tok=None):
    """AR samples (`tok` given) cut at the end of the reply's turn (EOS or the next ``<user>``);
    ReLF prompted samples are cut already (`workflows.sample_relf`)."""
    if tok is None:
        return samples
    from relf_jax.data.tokenizer import turn_stop_ids

    stops = set(turn_stop_ids(tok))
    ids, ended = [], []
    for body, done in zip(samples.token_ids, samples.complete):
        cut = next((i for i, t in enumerate(body) if t in stops), None)
        ids.append(body if cut is None else body[:cut])
        ended.append(done or cut is not None)
    return dataclasses.replace(samples, token_ids=ids, texts=[tok.decode(b) for b in ids], complete=ended)


def _relf_rows(record, lm, judge, n, steps, *, rounds, variant, renoise_pair=False, nfes=EULER_NFES):
    from relf_jax import workflows

    renoises = ("linear", "marginal") if renoise_pair else (lm.cfg.flow.renoise,)
    for renoise in renoises:
        s = workflows.sample_relf(lm, n, nfe=64, sampler="stochastic", renoise=renoise)
        record(_row(s, judge, method=f"relf stochastic {renoise}", nfe=64, reflow_rounds=rounds, steps=steps,
                    variant=variant, renoise=renoise, batch=lm.cfg.sample.batch_size))
    for nfe in nfes:
        s = workflows.sample_relf(lm, n, nfe=nfe, sampler="euler")
        record(_row(s, judge, method="relf euler", nfe=nfe, reflow_rounds=rounds, steps=steps, variant=variant,
                    batch=lm.cfg.sample.batch_size))


def _latency(ar_lm, relf_lm, *, length: int, batches: Sequence[int], reps: int = 3) -> dict:
    """One sequence of `length` tokens: AR (KV cache, no early stop) vs ReLF 16-NFE Euler,
    median of `reps` timed calls after a compiling one."""
    import jax

    from relf_jax import workflows
    from relf_jax.sampling import autoregressive as ar

    rows, ratio = [], {}
    for batch in batches:
        settings = ar.DecodeSettings(max_new_tokens=length - 1, eos_id=-1)
        prompts, lens = ar.pad_prompts([[ar_lm.tokenizer.bos_id]] * batch, ar_lm.tokenizer.pad_id, 8)
        sp = ar.SamplingParams.make(1.0)
        ar_times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(ar.generate(ar_lm.graphdef, ar_lm.params, prompts, lens, jax.random.key(i), sp,
                                              settings).tokens)
            ar_times.append(time.perf_counter() - t0)
        relf_times = [workflows.sample_relf(relf_lm, batch, nfe=16, sampler="euler", batch_size=batch, length=length,
                                            seed=i, warmup=i == 0).seconds for i in range(reps)]
        ar_s, relf_s = float(np.median(ar_times[1:])), float(np.median(relf_times))
        rows += [{"method": "ar (kv cache)", "nfe": length - 1, "batch": batch, "tokens": length, "latency_s": ar_s},
                 {"method": "relf euler", "nfe": 16, "batch": batch, "tokens": length, "latency_s": relf_s}]
        ratio[str(batch)] = ar_s / relf_s
        print(f"[bench relf] latency B={batch}: AR {ar_s * 1e3:.1f} ms, ReLF-16 {relf_s * 1e3:.1f} ms "
              f"({ratio[str(batch)]:.2f}x)", flush=True)
    return {"rows": rows, "ratio": ratio}


def ar_ppl_at_entropy(ar_rows: Sequence[dict], entropy: float) -> tuple[float, float]:
    """AR gen PPL at `entropy` by linear interpolation of log gen PPL over the AR sweep, and
    the distance (nats) from `entropy` to the nearest AR point (0 inside the swept range)."""
    pts = sorted((r["entropy"], math.log(r["gen_ppl"])) for r in ar_rows if r["gen_ppl"])
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if entropy <= xs[0]:
        return math.exp(ys[0]), xs[0] - entropy
    if entropy >= xs[-1]:
        return math.exp(ys[-1]), entropy - xs[-1]
    return math.exp(float(np.interp(entropy, xs, ys))), 0.0


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _reflow_targets(rows: Sequence[dict], variant: str, steps: int, prefix: str) -> dict:
    """The reflow targets of one model (`variant` at `steps`), keys starting with `prefix`:
    16-NFE Euler after two rounds over the pre-reflow 64-NFE row nearest its entropy, the 8-NFE
    Euler gen PPL reduction from two rounds, and per round the few-step gap (8-NFE Euler over
    64-NFE stochastic gen PPL: what straightening should close)."""
    def euler(nfe, rounds):
        return _pick(rows, variant=variant, train_steps=steps, nfe=nfe, reflow_rounds=rounds, method="relf euler")

    def nearest64(rounds, entropy):  # of the 64-NFE rows (one per renoise rule), the nearest in entropy
        s64 = [r for r in rows if r["variant"] == variant and r["train_steps"] == steps and r["nfe"] == 64
               and r["reflow_rounds"] == rounds]
        return min(s64, key=lambda r: abs(r["entropy"] - entropy), default=None)

    e16, e8_pre, e8_post = euler(16, 2), euler(8, 0), euler(8, 2)
    near = None if e16 is None else nearest64(0, e16["entropy"])
    if near is None or e8_pre is None or e8_post is None:
        return {}
    out = {f"{prefix}reflow2_euler16_over_pre_stochastic64_gen_ppl": {
        "ratio": _ratio(e16["gen_ppl"], near["gen_ppl"]), "entropy_delta": e16["entropy"] - near["entropy"],
        "target": "<= 1.10"},
        f"{prefix}reflow2_euler8_gen_ppl_reduction": {
        "reduction": None if _ratio(e8_post["gen_ppl"], e8_pre["gen_ppl"]) is None
        else 1.0 - e8_post["gen_ppl"] / e8_pre["gen_ppl"], "before": e8_pre["gen_ppl"],
        "after": e8_post["gen_ppl"], "entropy_delta": e8_post["entropy"] - e8_pre["entropy"], "target": ">= 0.20"}}
    gaps = {}
    for rounds in (0, 1, 2):
        e8 = euler(8, rounds)
        s = None if e8 is None else nearest64(rounds, e8["entropy"])
        if s is not None:
            gaps[str(rounds)] = {"ratio": _ratio(e8["gen_ppl"], s["gen_ppl"]),
                                 "entropy_delta": e8["entropy"] - s["entropy"]}
    out[f"{prefix}euler8_over_stochastic64_gen_ppl_by_reflow_round"] = gaps
    # the no-pairs control (`NO_PAIRS`): as many rounds of data-only training; reflow's own share
    # of the gain is how far its rows beat the control's
    control = {}
    for nfe in (8, 16):
        pre, post = euler(nfe, 0), euler(nfe, 2)
        ctrl = _pick(rows, variant=f"{variant}_nopairs", train_steps=steps, nfe=nfe, reflow_rounds=2,
                     method="relf euler")
        if pre is not None and post is not None and ctrl is not None and ctrl["gen_ppl"] and pre["gen_ppl"]:
            control[f"euler{nfe}"] = {"before": pre["gen_ppl"], "reflow2": post["gen_ppl"], "nopairs2": ctrl["gen_ppl"],
                                      "nopairs2_reduction": 1.0 - ctrl["gen_ppl"] / pre["gen_ppl"],
                                      "reflow2_over_nopairs2": _ratio(post["gen_ppl"], ctrl["gen_ppl"]),
                                      "entropy_delta_reflow2_minus_nopairs2": post["entropy"] - ctrl["entropy"]}
    if control:
        out[f"{prefix}reflow2_vs_nopairs_control"] = control
    return out


def targets(rows: Sequence[dict], budgets: Sequence[int], prompted: Sequence[dict] = ()) -> dict:
    """The issue's targets as measured ratios (lower gen PPL is better), and the prompted replies'
    gen PPL of clean-prompt training over the renoised prompt (not an issue target)."""
    out = {}
    for nfe in (64, 16):
        clean = _pick(prompted, variant="prompt_training", prompt_mode="clean", nfe=nfe)
        renoised = _pick(prompted, variant="relf", prompt_mode="renoise", nfe=nfe)
        if clean and renoised:
            out[f"prompted_reply_gen_ppl_clean_over_renoise_nfe{nfe}"] = {
                "ratio": _ratio(clean["gen_ppl"], renoised["gen_ppl"]),
                "entropy_delta": clean["entropy"] - renoised["entropy"]}
    for steps in budgets:
        ar_rows = [r for r in rows if r["variant"] == "ar" and r["train_steps"] == steps and r["gen_ppl"]]
        # of the 64-NFE rows (one per renoise rule), the one nearest the AR sweep's entropies
        pre = [r for r in rows if r["variant"] == "relf" and r["train_steps"] == steps and r["nfe"] == 64
               and r["reflow_rounds"] == 0]
        if not ar_rows or not pre:  # a run without the "models" part
            continue
        r64 = min(pre, key=lambda r: ar_ppl_at_entropy(ar_rows, r["entropy"])[1])
        ppl, gap = ar_ppl_at_entropy(ar_rows, r64["entropy"])
        out[f"steps{steps}_relf64_vs_ar_at_matched_entropy"] = {
            "relf_gen_ppl": r64["gen_ppl"], "relf_entropy": r64["entropy"], "ar_gen_ppl_interpolated": ppl,
            "entropy_outside_ar_sweep_nats": gap, "ratio": _ratio(r64["gen_ppl"], ppl), "target": "<= 1.15"}
    uni = _pick(rows, variant="reference", method="positional unigram")
    if uni is not None:
        pre = [r for r in rows if r["variant"] == "relf" and r["reflow_rounds"] == 0]
        out["relf_over_positional_unigram_gen_ppl"] = {
            "positional_unigram": {"gen_ppl": uni["gen_ppl"], "entropy": uni["entropy"]},
            "best_relf_ratio": min((_ratio(r["gen_ppl"], uni["gen_ppl"]) for r in pre if r["gen_ppl"]), default=None)}
    full = budgets[0]

    def sampled_alike(steps):  # ablation and guidance rows use the default (marginal) renoise
        return (_pick(rows, variant="relf", train_steps=steps, nfe=64, reflow_rounds=0,
                      method="relf stochastic marginal")
                or _pick(rows, variant="relf", train_steps=steps, nfe=64, reflow_rounds=0))

    pre64 = sampled_alike(full)
    for variant, prefix in (("relf", ""), *((v, f"{v}_") for v in REFLOW_EXTENSIONS)):
        out.update(_reflow_targets(rows, variant, full, prefix))
    abl = {}
    for name in ABLATIONS:
        r = next((x for x in rows if x["variant"] == name), None)
        if r is not None:
            base = sampled_alike(r["train_steps"])
            abl[name] = {"gen_ppl_over_baseline": _ratio(r["gen_ppl"], base["gen_ppl"]),
                         "entropy_delta": r["entropy"] - base["entropy"], "train_steps": r["train_steps"]}
    for g in GUIDANCE[1:]:
        r = _pick(rows, variant="guidance", train_steps=full, guidance=g)
        if r is not None:
            abl[f"guidance_{g:g}"] = {"gen_ppl_over_baseline": _ratio(r["gen_ppl"], pre64["gen_ppl"]),
                                      "entropy_delta": r["entropy"] - pre64["entropy"]}
    if abl:
        out["ablations_vs_relf64"] = abl
    ext = {}
    for name in EXTENSIONS:
        for nfe, method in ((64, "relf stochastic marginal"), (16, "relf euler")):
            r = _pick(rows, variant=name, nfe=nfe, method=method)
            base = _pick(rows, variant="relf", train_steps=full, nfe=nfe, reflow_rounds=0, method=method)
            ar_full = [x for x in rows if x["variant"] == "ar" and x["train_steps"] == full]
            if r is not None and base is not None and ar_full:
                ar_ppl, gap = ar_ppl_at_entropy(ar_full, r["entropy"])
                ext[f"{name}_nfe{nfe}"] = {"gen_ppl_over_relf": _ratio(r["gen_ppl"], base["gen_ppl"]),
                                           "entropy_delta": r["entropy"] - base["entropy"],
                                           "gen_ppl_over_ar_at_matched_entropy": _ratio(r["gen_ppl"], ar_ppl),
                                           "entropy_outside_ar_sweep_nats": gap}
    if ext:
        out["extensions_vs_relf"] = ext
    marg = _pick(rows, variant="relf", train_steps=full, nfe=64, reflow_rounds=0, renoise="marginal")
    lin = _pick(rows, variant="relf", train_steps=full, nfe=64, reflow_rounds=0, renoise="linear")
    if marg and lin:
        out["renoise_marginal_over_linear"] = {"gen_ppl": _ratio(marg["gen_ppl"], lin["gen_ppl"]),
                                               "entropy_delta": marg["entropy"] - lin["entropy"]}
    return out
