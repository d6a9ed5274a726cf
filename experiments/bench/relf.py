"""`relf-jax bench relf`: ReLF vs AR on `synthetic_chat` under the exact judge, in one run.

Composition only (every step is a library call). For each of two training
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
import os
import time
from collections.abc import Sequence

import relf_jax as rj
from experiments.bench.common import held_out_prompts
from experiments.bench.relf_core import bench_relf_core
from experiments.bench.relf_rows import latency_rows, prompted_rows, relf_rows, result_row, run_dir
from experiments.bench.relf_targets import targets
from experiments.bench.relf_variants import (
    ABLATIONS,
    AR_TEMPERATURES,
    DEFAULT_PARTS,
    EULER_NFES,
    EXTENSIONS,
    GUIDANCE,
    NO_PAIRS,
    PARTS,
    PROMPT_TRAINING,
    QUICK_AR_TEMPERATURES,
    REFLOW_EXTENSIONS,
)
from relf_jax.config import make_config
from relf_jax.data.prepare import prepare_data, prepare_tokenizer
from relf_jax.eval.baselines import positional_unigram_samples
from relf_jax.eval.evaluate import exact_judge
from relf_jax.flow.generate import sample_relf
from relf_jax.flow.recipes import reflow
from relf_jax.flow.reflow import DATA_WEIGHT
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.speculative.recipes import sample


def bench_relf(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
               parts: Sequence[str] = DEFAULT_PARTS, budgets: Sequence[int] | None = None,
               variants: Sequence[str] | None = None, ar_rows: str | None = None) -> dict:
    """Runs the parts named in `parts`: "models" (the AR sweep, ReLF rows at both budgets,
    ablations, guidance, extensions, prompted replies, the unigram reference), "reflow" (two
    reflow rounds and two no-pairs control rounds of the plain and `REFLOW_EXTENSIONS` models,
    with rows before and after each) and "latency"; those three by default. "core" alone
    (`bench_relf_core`) is the issue-35 comparison at one budget: the unigram reference, the AR
    sweep, the default ReLF and the paper's plain parametrisation, with text tokens per step;
    `budgets` and `ar_rows` apply to it only (see `bench_relf_core`). `variants` names the core
    part's models, or, with "reflow" alone, whose reflow studies run ("relf", `REFLOW_EXTENSIONS`;
    default all)."""
    from relf_jax.errors import UserError

    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts or ("core" in parts and len(parts) > 1):
        raise UserError(f"bench relf parts must be a non-empty subset of {', '.join(PARTS[:3])}, or core alone; "
                        f"got {list(parts)}")
    if "core" in parts:
        return bench_relf_core(out, quick=quick, workdir=workdir, overrides=overrides, budgets=budgets,
                               variants=variants, ar_rows=ar_rows)
    if budgets or ar_rows:
        raise UserError("budgets and ar_rows apply to bench relf --parts core only")
    reflow_models = ("relf", *REFLOW_EXTENSIONS)
    if variants is not None and (tuple(parts) != ("reflow",) or not variants or set(variants) - set(reflow_models)):
        raise UserError(f"bench relf --variants applies to --parts core, or to --parts reflow alone with models "
                        f"among {', '.join(reflow_models)}; got parts {list(parts)}, variants {list(variants)}")
    return _ReLFBench(out, quick, workdir, overrides, parts, tuple(variants or reflow_models)).run()


class _ReLFBench:
    """One `bench relf` run: the shared data, the rows measured so far (written after each), and
    the steps of the run (`run`: for each budget, `budget`)."""

    def __init__(self, out: str, quick: bool, workdir: str | None, overrides: Sequence[str], parts: Sequence[str],
                 reflow_models: Sequence[str]):
        self.out, self.quick, self.overrides, self.parts = out, quick, list(overrides), parts
        self.reflow_models = reflow_models  # the models whose reflow studies run ("relf" and / or extensions)
        self.preset = preset = "tiny" if quick else "cpu"
        self.root = os.path.abspath(workdir or os.path.join("runs", f"bench_relf_{preset}"))
        self.base = make_config(preset, list(overrides), workdir=os.path.join(self.root, "shared"))
        # one data set and tokenizer for every model of the run
        self.builder = prepare_data(self.base)
        self.tok = prepare_tokenizer(self.base, self.builder)
        self.judge = exact_judge(self.base)
        # samples per row: at 64, four seeds of one row (the blind-spot model, 8-NFE Euler) gave gen
        # PPL 473-559, too wide for the 20 % reflow target; at 256 two seeds gave 523 and 526
        self.n = 32 if quick else 256
        self.temps = QUICK_AR_TEMPERATURES if quick else AR_TEMPERATURES
        self.full = full = self.base.train.steps
        self.models = "models" in parts
        self.budgets = (full, max(1, full // 2)) if self.models else (full,)
        self.pairs, self.reflow_steps = (64 if quick else 512), max(1, full // 2)
        self.rows, self.prompted, self.straight, self.latency = [], [], {}, {"rows": [], "ratio": {}}

    def record(self, row: dict) -> None:
        self.rows.append(row)
        write_json(self.out, {"preset": self.preset, "complete": False, "parts": list(self.parts),
                              "rows": self.rows})  # nothing lost
        ppl = "   empty" if row["gen_ppl"] is None else f"{row['gen_ppl']:8.2f}"
        print(f"[bench relf] {row['train_steps']:>5} steps {row['method']:>26} nfe {row['nfe']!s:>4} "
              f"reflow {row['reflow_rounds']}: gen PPL {ppl}  entropy {row['entropy']:.2f}  "
              f"{row['latency_s'] * 1e3:8.1f} ms/batch", flush=True)

    def train_relf(self, name: str, steps: int, extra: Sequence[str]):
        """(run directory, model): a ReLF model with overrides `extra`, in its own directory `name`."""
        wd = run_dir(self.root, name, self.base)
        rj.train(make_config(self.preset, [*self.overrides, f"train.steps={steps}", "model=relf", *extra],
                                       workdir=wd))
        return wd, load_model(os.path.join(wd, "relf"), "relf")

    def reflow_study(self, model_wd: str, variant: str) -> dict:
        """Two reflow rounds and two no-pairs control rounds from the model in `model_wd`/relf."""
        study = {}
        for kind, extra, name in (("pairs", {}, "relf_reflow"), ("nopairs", NO_PAIRS, "relf_nopairs")):
            study[kind] = reflow(model_wd, rounds=2, num_pairs=self.pairs, steps=self.reflow_steps,
                                           name=name, **extra)
            for r in (1, 2):
                rlm = load_model(os.path.join(model_wd, f"{name}{r}"), "relf")
                relf_rows(self.record, rlm, self.judge, self.n, self.full, rounds=r,
                          variant=variant if kind == "pairs" else f"{variant}_nopairs",
                          nfes=EULER_NFES if kind == "pairs" else (8, 16))
        return study

    def run(self) -> dict:
        t0 = time.perf_counter()
        if self.models:
            uni = positional_unigram_samples(self.builder, self.tok, self.n, self.base.data.seq_len)
            self.record(result_row(uni, self.judge, method="positional unigram", nfe=None, reflow_rounds=0, steps=0,
                                   variant="reference"))
        for steps in self.budgets:
            self.budget(steps)
        report = {"preset": self.preset, "complete": True, "parts": list(self.parts), "num_samples": self.n,
                  "budgets_steps": list(self.budgets),
                  "tokens_per_step": self.base.train.batch_size * self.base.data.seq_len,
                  "reflow": {"rounds": 2, "pairs": self.pairs, "steps_per_round": self.reflow_steps,
                             "data_weight": DATA_WEIGHT, "no_pairs": NO_PAIRS},
                  "rows": self.rows, "latency": self.latency["rows"],
                  "latency_ratio_ar_over_relf16": self.latency["ratio"],
                  "straightness": self.straight, "prompted": self.prompted,
                  "targets": targets(self.rows, self.budgets, self.prompted),
                  "judge": self.judge.name,
                  "wall_s": time.perf_counter() - t0}
        write_json(self.out, report)
        print(json.dumps(report["targets"], indent=2))
        print(json.dumps(report["latency_ratio_ar_over_relf16"]))
        return report

    def budget(self, steps: int) -> None:
        """The rows of one training budget: the AR sweep, the default ReLF; at the smaller budget the
        ablations, at the full one the rest (`full_budget`)."""
        wd = run_dir(self.root, f"steps{steps}", self.base)
        cfg = make_config(self.preset, [*self.overrides, f"train.steps={steps}"], workdir=wd)
        ar_lm = None
        if self.models or "latency" in self.parts:
            rj.train(cfg)
            ar_lm = load_model(wd, "ar")
        for temperature in self.temps if self.models else ():
            sc = dataclasses.replace(ar_lm.cfg.sample, temperature=temperature, top_k=0, top_p=1.0,
                                     max_new_tokens=cfg.data.seq_len - 1, num_samples=self.n)
            s = sample(ar_lm, n=self.n, sample_cfg=sc)
            self.record(result_row(s, self.judge, method=f"ar T={temperature:g}", nfe=None, reflow_rounds=0,
                                   steps=steps, variant="ar", temperature=temperature, batch=sc.batch_size))
        rj.train(make_config(self.preset, [*self.overrides, f"train.steps={steps}", "model=relf"],
                                       workdir=wd))
        lm = load_model(os.path.join(wd, "relf"), "relf")
        if self.models or "reflow" in self.parts:
            relf_rows(self.record, lm, self.judge, self.n, steps, rounds=0, variant="relf", renoise_pair=True)
        if steps != self.full:
            # ablations at the smaller budget (CPU time), against that budget's ReLF rows
            for name, extra in ABLATIONS.items():
                _, alm = self.train_relf(f"steps{steps}_{name}", steps, extra)
                s = sample_relf(alm, self.n, nfe=64, sampler="stochastic")
                self.record(result_row(s, self.judge, method=f"relf stochastic {name}", nfe=64, reflow_rounds=0,
                                       steps=steps, variant=name, batch=alm.cfg.sample.batch_size))
            return
        self.full_budget(wd, cfg, steps, ar_lm, lm)

    def full_budget(self, wd: str, cfg, steps: int, ar_lm, lm) -> None:
        """Guidance, prompt training, the extensions, prompted replies, the reflow studies, latency."""
        plm = None
        if self.models:
            for g in GUIDANCE[1:]:
                s = sample_relf(lm, self.n, nfe=64, sampler="stochastic", guidance=g)
                self.record(result_row(s, self.judge, method=f"relf stochastic w={g:g}", nfe=64, reflow_rounds=0,
                                       steps=steps, variant="guidance", guidance=g, batch=lm.cfg.sample.batch_size))
            _, plm = self.train_relf(f"steps{steps}_prompt_training", steps, PROMPT_TRAINING)
            s = sample_relf(plm, self.n, nfe=64, sampler="stochastic")
            self.record(result_row(s, self.judge, method="relf stochastic prompt_training", nfe=64, reflow_rounds=0,
                                   steps=steps, variant="prompt_training", batch=plm.cfg.sample.batch_size))
        for name, extra in EXTENSIONS.items():
            with_reflow = name in REFLOW_EXTENSIONS and "reflow" in self.parts and name in self.reflow_models
            if not (self.models or with_reflow):
                continue
            ewd, elm = self.train_relf(f"steps{steps}_{name}", steps, extra)
            relf_rows(self.record, elm, self.judge, self.n, steps, rounds=0, variant=name,
                      nfes=EULER_NFES if name in REFLOW_EXTENSIONS else (16,))
            if with_reflow:
                self.straight[name] = self.reflow_study(ewd, name)
        if self.models:
            self.prompted = prompted_rows(ar_lm, lm, plm, self.judge,
                                          held_out_prompts(cfg, 16 if self.quick else 128), steps=steps)
        if "reflow" in self.parts and "relf" in self.reflow_models:
            self.straight["relf"] = self.reflow_study(wd, "relf")
        if "latency" in self.parts:
            self.latency = latency_rows(ar_lm, lm, length=cfg.data.seq_len, batches=(1, 64))
