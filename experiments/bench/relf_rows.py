"""The rows of `relf-jax bench relf`: run directories sharing one data set, a sample set's result
row, the ReLF sampler rows of one model, latency rows and prompted replies."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from collections.abc import Sequence

import jax
import numpy as np

from experiments.bench.common import reply_quality
from experiments.bench.relf_variants import EULER_NFES
from relf_jax.data.tokenizer import encode_prompt, turn_stop_ids
from relf_jax.eval.evaluate import evaluate_samples
from relf_jax.flow.generate import sample_relf
from relf_jax.sampling import autoregressive as ar
from relf_jax.speculative.recipes import sample


def run_dir(root: str, name: str, base) -> str:
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


def result_row(samples, judge, *, method, nfe, reflow_rounds, steps, variant, batch: int = 8, **extra) -> dict:
    """One result row; latency_s is the decode time of one batch of `batch` sequences."""
    q = evaluate_samples(samples, judge)
    batches = max(1, math.ceil(len(samples.texts) / batch))
    # all-empty samples (a degenerate model) have no gen PPL: null in the JSON, not NaN
    ppl = q["gen_ppl"] if math.isfinite(q["gen_ppl"]) else None
    return {"method": method, "nfe": nfe, "reflow_rounds": reflow_rounds, "gen_ppl": ppl,
            "entropy": q["entropy"], "pooled_entropy": q["pooled_entropy"], "latency_s": samples.seconds / batches,
            "batch": batch,
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
    sc = ar_lm.cfg.sample
    longest = max(len(encode_prompt(ar_lm.tokenizer, p)) for p in prompts)
    room = min(relf_lm.cfg.data.seq_len, ar_lm.model_cfg.max_seq_len) - longest
    runs = [(f"ar T={t:g}", None, "ar", "-", lambda t=t: sample(
        ar_lm, prompts, sample_cfg=dataclasses.replace(sc, temperature=t, top_k=0, top_p=1.0, max_new_tokens=room)))
        for t in (1.0, 0.8)]
    for label, model, mode in (("relf", relf_lm, "renoise"), ("relf prompt_training", prompt_lm, "clean"),
                               ("relf prompt_training", prompt_lm, "renoise")):
        for sampler, nfe in (("stochastic", 64), ("euler", 16)):
            runs.append((f"{label} {sampler} prompt {mode}", nfe, "relf" if model is relf_lm else "prompt_training",
                         mode, lambda m=model, s=sampler, k=nfe, pm=mode: sample_relf(
                             m, prompts=prompts, nfe=k, sampler=s, prompt_mode=pm)))
    rows = []
    for method, nfe, variant, mode, run in runs:
        samples = cut_turns(run(), ar_lm.tokenizer if variant == "ar" else None)
        q = reply_quality(judge, prompts, samples.texts)  # reply words scored as a prefix
        row = {"method": method, "nfe": nfe, "variant": variant, "prompt_mode": mode, "train_steps": steps,
               "gen_ppl": q["gen_ppl"], "entropy": q["entropy"], "reply_words": q["reply_words"],
               "ended": float(np.mean(samples.complete))}
        rows.append(row)
        log(f"[bench relf] prompted {method:>44} nfe {nfe!s:>4}: reply gen PPL {row['gen_ppl']:9.2f}  entropy "
            f"{row['entropy']:.2f}  {row['reply_words']:.1f} words, {row['ended']:.0%} ended", flush=True)
    return rows


def cut_turns(samples, tok=None):
    """AR samples (`tok` given) cut at the end of the reply's turn (EOS or the next ``<user>``);
    ReLF prompted samples are cut already (`sample_relf`)."""
    if tok is None:
        return samples
    stops = set(turn_stop_ids(tok))
    ids, ended = [], []
    for body, done in zip(samples.token_ids, samples.complete):
        cut = next((i for i, t in enumerate(body) if t in stops), None)
        ids.append(body if cut is None else body[:cut])
        ended.append(done or cut is not None)
    return dataclasses.replace(samples, token_ids=ids, texts=[tok.decode(b) for b in ids], complete=ended)


def relf_rows(record, lm, judge, n, steps, *, rounds, variant, renoise_pair=False, nfes=EULER_NFES):
    renoises = ("linear", "marginal") if renoise_pair else (lm.cfg.flow.renoise,)
    for renoise in renoises:
        s = sample_relf(lm, n, nfe=64, sampler="stochastic", renoise=renoise)
        record(result_row(s, judge, method=f"relf stochastic {renoise}", nfe=64, reflow_rounds=rounds,
                          steps=steps, variant=variant, renoise=renoise, batch=lm.cfg.sample.batch_size))
    for nfe in nfes:
        s = sample_relf(lm, n, nfe=nfe, sampler="euler")
        record(result_row(s, judge, method="relf euler", nfe=nfe, reflow_rounds=rounds, steps=steps,
                          variant=variant, batch=lm.cfg.sample.batch_size))


def latency_rows(ar_lm, relf_lm, *, length: int, batches: Sequence[int], reps: int = 3) -> dict:
    """One sequence of `length` tokens: AR (KV cache, no early stop) vs ReLF 16-NFE Euler,
    median of `reps` timed calls after a compiling one."""
    rows, ratio = [], {}
    for batch in batches:
        settings = ar.DecodeSettings(max_new_tokens=length - 1, eos_id=-1)
        prompts, lens = ar.pad_prompts([[ar_lm.tokenizer.bos_id]] * batch, ar_lm.tokenizer.pad_id, 8)
        sp = ar.TracedSampling.make(1.0)
        ar_times = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(ar.generate(ar_lm.graphdef, ar_lm.params, prompts, lens, jax.random.key(i), sp,
                                              settings).tokens)
            ar_times.append(time.perf_counter() - t0)
        relf_times = [sample_relf(relf_lm, batch, nfe=16, sampler="euler", batch_size=batch, length=length,
                                            seed=i, warmup=i == 0).seconds for i in range(reps)]
        ar_s, relf_s = float(np.median(ar_times[1:])), float(np.median(relf_times))
        rows += [{"method": "ar (kv cache)", "nfe": length - 1, "batch": batch, "tokens": length, "latency_s": ar_s},
                 {"method": "relf euler", "nfe": 16, "batch": batch, "tokens": length, "latency_s": relf_s}]
        ratio[str(batch)] = ar_s / relf_s
        print(f"[bench relf] latency B={batch}: AR {ar_s * 1e3:.1f} ms, ReLF-16 {relf_s * 1e3:.1f} ms "
              f"({ratio[str(batch)]:.2f}x)", flush=True)
    return {"rows": rows, "ratio": ratio}
