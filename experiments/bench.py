"""`relf-jax bench ...`: measurements that take minutes, written as JSON with ratios.

Composition only. Every row of a benchmark is measured in the same process, one after the
other, on the same prompts, so ratios between rows are meaningful on a noisy machine.

- ``bench spec``: AR vs speculative decoding (standard / NSD / greedy rules, draft-model,
  prompt-lookup and corpus n-gram proposers) at batch 1 and 8, temperature 1.0 and 0.7: tokens/s, tau (tokens
  per target forward) and, for quality, gen PPL (exact judge, replies scored given their
  prompts) and entropy; plus the target's forward cost over K + 1 tokens relative to one token
  (`target_forward_cost`), which decides whether speculation can pay on this hardware.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Optional, Sequence

import numpy as np

from relf_jax.config import SpeculativeConfig, make_config
from relf_jax.eval.metrics import mean_unigram_entropy


def _write_json(path: str, obj) -> None:
    """Write `obj` to `path` atomically (a temporary file, then a rename): an interrupted write
    leaves the previous report whole, never a torn one."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def draft_steps(cfg) -> int:
    """The distillation steps of the demo's draft: half the target's."""
    return max(1, cfg.train.steps // 2)


def _ensure_target_and_draft(preset: str, workdir: str, overrides: Sequence[str] = ()):
    from relf_jax import workflows  # the data stack; `bench verify` runs without it
    cfg = make_config(preset, list(overrides), workdir=workdir)
    workflows.train_lm(cfg)
    lm = workflows.load_model(workdir, "ar")
    workflows.train_draft(workdir, [f"train.steps={draft_steps(cfg)}"])  # as the demo does
    draft = workflows.load_model(os.path.join(workdir, "draft"), "ar")
    return cfg, lm, draft


def held_out_prompts(cfg, n: int, seed: int = 12345) -> list[str]:
    """First user turns (ending with ``<assistant>``) of fresh grammar conversations."""
    from relf_jax import workflows
    judge = workflows.exact_judge(cfg)
    return [info["prompt"] for info in judge.grammar.sample_with_info(n, seed)]


def reply_quality(judge, prompts: Sequence[str], samples) -> dict:
    """Gen PPL of the replies given their prompts under the exact judge, and their entropy."""
    logp, n = judge.score_replies(prompts, samples.texts, samples.complete)
    return {"gen_ppl": float(math.exp(-logp.sum() / max(n.sum(), 1))),
            "entropy": mean_unigram_entropy([t.split() for t in samples.texts])}


def bench_spec(out: str, quick: bool = False, workdir: Optional[str] = None, overrides: Sequence[str] = ()) -> dict:
    from relf_jax import workflows

    preset = "tiny" if quick else "cpu"
    workdir = workdir or os.path.join("runs", f"bench_spec_{preset}")
    cfg, lm, draft = _ensure_target_and_draft(preset, workdir, overrides)
    judge = workflows.exact_judge(cfg)
    max_new = 32 if quick else 64
    n_prompts = 8 if quick else 16
    prompts = held_out_prompts(cfg, n_prompts)
    k = 4
    variants = [("ar", "none", "-", None)]
    for proposer in ("draft", "prompt_lookup", "corpus_ngram"):
        variants += [("speculative", "standard", proposer, None), ("speculative", "greedy", proposer, None)]
        for nsd in ((0.8, 0.9, 0.95) if proposer == "draft" else (0.9,)):
            variants.append(("speculative", "nsd", proposer, nsd))
    rows = []
    t0 = time.perf_counter()
    for batch in (1, 8):
        for temperature in (1.0, 0.7):
            sc = dataclasses.replace(cfg.sample, batch_size=batch, max_new_tokens=max_new, temperature=temperature,
                                     top_k=0, top_p=1.0, seed=0)
            for method, rule, proposer, nsd in variants:
                spc = SpeculativeConfig(rule=rule, k=k, proposer=proposer if proposer != "-" else "draft",
                                        nsd_top_p=nsd or 0.9)
                s = workflows.sample(lm, prompts=prompts, sample_cfg=sc, speculative=spc,
                                     draft=draft if proposer == "draft" else None)
                q = reply_quality(judge, prompts, s)
                row = {"method": method if rule == "none" else f"{rule}" + (f"@{nsd}" if nsd else ""),
                       "rule": rule, "proposer": proposer, "nsd_top_p": nsd, "temperature": temperature,
                       "batch": batch, "k": k if rule != "none" else None, "tokens_per_s": s.tokens_per_s,
                       "tau": s.tau, **q}
                rows.append(row)
                print(f"[bench spec] b={batch} T={temperature} {row['method']:>12} {proposer:>13}: "
                      f"{s.tokens_per_s:8.1f} tok/s  tau {s.tau:4.2f}  gen PPL {q['gen_ppl']:7.2f}  "
                      f"entropy {q['entropy']:.2f}", flush=True)
    report = {"rows": rows, "ratios": _spec_ratios(rows), "preset": preset, "k": k, "max_new_tokens": max_new,
              "num_prompts": n_prompts, "wall_s": time.perf_counter() - t0,
              "draft_cost_ratio": _cost_ratio(lm, draft),
              # verification cost: K + 1 tokens in one target forward vs one token
              "target_forward_cost": forward_costs(lm, k)}
    _write_json(out, report)
    print(json.dumps(report["ratios"], indent=2))
    return report


def _find(rows, **kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


def _spec_ratios(rows) -> dict:
    out = {}
    for batch in (1, 8):
        for temperature in (1.0, 0.7):
            base = dict(batch=batch, temperature=temperature)
            ar_row = _find(rows, rule="none", **base)
            std = _find(rows, rule="standard", proposer="draft", **base)
            nsd = _find(rows, rule="nsd", proposer="draft", nsd_top_p=0.9, **base)
            key = f"b{batch}_T{temperature}"
            ngram = {}
            for rule in ("standard", "nsd"):
                r = _find(rows, rule=rule, proposer="corpus_ngram", **base)
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
    return out


def forward_costs(lm, k: int, batches: Sequence[int] = (1, 8), context: int = 64, reps: int = 10) -> dict:
    """Median ms of the target's cached forward over 1 token and over K + 1 tokens, per batch.

    Speculative decoding pays off only when verifying K + 1 tokens costs much less than K + 1
    one-token steps (memory-bound hardware); on a compute-bound CPU the ratio is close to K + 1.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from relf_jax.models.causal_lm import init_cache

    loops = 16

    @jax.jit
    def fwd(params, tokens, cache, index):
        # `loops` forwards in one while_loop, as inside the decoding loops (no dispatch cost);
        # each depends on the previous one, so nothing is hoisted out of the loop
        model = nnx.merge(lm.graphdef, params)
        t = tokens.shape[1]
        positions = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None]

        def body(_, carry):
            toks, acc = carry
            logits = model(toks, positions, cache=cache, cache_index=index)[0]
            nxt = (toks + (jnp.argmax(logits, -1) > 10 ** 9).astype(jnp.int32))
            return nxt, acc + logits[:, -1, 0].sum()

        return jax.lax.fori_loop(0, loops, body, (tokens, jnp.float32(0)))[1]

    out = {}
    for b in batches:
        cache = init_cache(lm.model_cfg, b, context + k + 1)
        index = jnp.full((b,), context, jnp.int32)
        ms = {}
        for t in (1, k + 1):
            tokens = jnp.full((b, t), 5, jnp.int32)
            jax.block_until_ready(fwd(lm.params, tokens, cache, index))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(fwd(lm.params, tokens, cache, index))
                times.append(time.perf_counter() - t0)
            ms[t] = 1e3 * float(np.median(times)) / loops
        out[f"b{b}"] = {"one_token_ms": ms[1], f"{k + 1}_tokens_ms": ms[k + 1],
                        "ratio": ms[k + 1] / ms[1]}
    return out


def _cost_ratio(lm, draft) -> float:
    """Target / draft parameter count (excluding embeddings): how much cheaper a draft step is."""
    import jax

    def count(m):
        return sum(x.size for x in jax.tree.leaves(m.params)) - m.model_cfg.vocab_size * m.model_cfg.d_model

    return count(lm) / max(count(draft), 1)


def bench_verify(out: str, quick: bool = False, workdir: Optional[str] = None, overrides: Sequence[str] = ()) -> dict:
    """Pallas verification kernel vs the jnp reference: agreement and time, in one run.

    On a GPU/TPU the kernel is compiled (V = 32k, K = 4 and 8, B = 1, 8, 64); on a CPU it can
    only be interpreted, so ``--quick`` there checks agreement at toy shapes and its times say
    nothing about speed.
    """
    import jax
    import jax.numpy as jnp

    from kernels_pallas import verify as kv
    from relf_jax.sampling import processors

    del workdir, overrides
    backend = jax.default_backend()
    interpret = backend == "cpu"
    shapes = [(b, k, 512 if quick else 32768) for k in (4, 8) for b in ((1, 8) if quick else (1, 8, 64))]
    reps = 3 if quick else 20
    rows = []
    for b, k, v in shapes:
        rng = jax.random.key(b * 100 + k)
        k1, k2, k3, k4, k5 = jax.random.split(rng, 5)
        target = (2.0 * jax.random.normal(k1, (b, k + 1, v))).astype(jnp.bfloat16)
        draft = target[:, :k] + (0.5 * jax.random.normal(k2, (b, k, v))).astype(jnp.bfloat16)
        tokens = jax.random.categorical(k3, draft.astype(jnp.float32), axis=-1).astype(jnp.int32)
        u = jax.random.uniform(k4, (b, k))
        e = jax.random.exponential(k5, (b, v))
        for rule in ("standard", "nsd"):
            settings = dict(rule=rule, temperature=1.0, top_p=0.95, nsd_top_p=0.9)
            ref = jax.jit(lambda *a, s=settings: kv.ref_verify(*a, log_probs_fn=processors.log_probs, **s))
            ker = jax.jit(lambda *a, s=settings: kv.verify(*a, interpret=interpret, **s))
            args = (target, draft, tokens, u, e)
            r_out, k_out = jax.block_until_ready(ref(*args)), jax.block_until_ready(ker(*args))
            agree = all(bool(jnp.array_equal(x, y)) for x, y in zip(r_out, k_out))
            times = {}
            for name, fn in (("reference", ref), ("kernel", ker)):
                samples = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    samples.append(time.perf_counter() - t0)
                times[name] = float(np.median(samples))
            row = {"batch": b, "k": k, "vocab": v, "rule": rule, "agree": agree,
                   "reference_ms": times["reference"] * 1e3, "kernel_ms": times["kernel"] * 1e3,
                   "speedup_kernel_over_reference": times["reference"] / times["kernel"]}
            rows.append(row)
            print(f"[bench verify] {backend} B={b:>2} K={k} V={v} {rule:>8}: agree={agree} "
                  f"ref {row['reference_ms']:.3f} ms  kernel {row['kernel_ms']:.3f} ms  "
                  f"x{row['speedup_kernel_over_reference']:.2f}", flush=True)
    report = {"backend": backend, "interpret": interpret, "device": str(jax.devices()[0]), "rows": rows}
    _write_json(out, report)
    return report


def bench_latency(out: str, quick: bool = False, workdir: Optional[str] = None, overrides: Sequence[str] = ()) -> dict:
    """Latency of one reply: AR with a KV cache (one forward per token) vs ReLF at 16 NFE
    (all positions in parallel), same preset and width, batch 1 and 64, in one run.

    Latency does not depend on the weights, so both models are freshly initialised: no data
    stack is needed (it runs on a bare accelerator machine). `--quick`: tiny preset, 64 tokens.
    """
    import jax
    from flax import nnx

    from relf_jax.flow.samplers import FlowSamplerSettings
    from relf_jax.flow.samplers import sample as flow_sample
    from relf_jax.models import build_model
    from relf_jax.sampling import autoregressive as ar

    del workdir
    preset = "tiny" if quick else "small"
    cfg = make_config(preset, list(overrides))
    length = 64 if quick else 1024
    vocab = 512 if quick else cfg.data.vocab_size
    rows, reps = [], 3
    for family in ("ar", "relf"):
        mcfg = dataclasses.replace(cfg.model, family=family, vocab_size=vocab, max_seq_len=max(length + 8, 128))
        graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(0)))
        for batch in (1, 64):
            if family == "ar":
                settings = ar.DecodeSettings(max_new_tokens=length, eos_id=-1)
                prompts, lens = ar.pad_prompts([[2]] * batch, bucket=8)
                sp = ar.SamplingParams.make(1.0)

                def run(key, _p=prompts, _l=lens, _s=settings, _sp=sp):
                    return ar.generate(graphdef, params, _p, _l, key, _sp, _s).tokens
                nfe = length
            else:
                table = jax.random.normal(jax.random.key(1), (vocab, mcfg.flow_embed_dim))
                fs = FlowSamplerSettings(nfe=16, sampler="euler")

                @jax.jit
                def relf(params, key, table, _b=batch):
                    return flow_sample(key, lambda z, t, sc: nnx.merge(graphdef, params)(z, sc, t), table, fs,
                                       batch=_b, length=length)[0]

                def run(key, _t=table):
                    return relf(params, key, _t)
                nfe = 16
            jax.block_until_ready(run(jax.random.key(0)))
            times = []
            for i in range(reps):
                t0 = time.perf_counter()
                jax.block_until_ready(run(jax.random.key(i + 1)))
                times.append(time.perf_counter() - t0)
            row = {"method": "ar (kv cache)" if family == "ar" else "relf euler", "nfe": nfe, "batch": batch,
                   "tokens": length, "latency_s": float(np.median(times))}
            rows.append(row)
            print(f"[bench latency] {jax.default_backend()} {preset} {row['method']:>14} B={batch:>2}: "
                  f"{row['latency_s'] * 1e3:9.1f} ms for {length} tokens", flush=True)
    ratio = {str(b): _find(rows, method="ar (kv cache)", batch=b)["latency_s"]
             / _find(rows, method="relf euler", batch=b)["latency_s"] for b in (1, 64)}
    report = {"backend": jax.default_backend(), "device": str(jax.devices()[0]), "preset": preset, "rows": rows,
              "latency_ratio_ar_over_relf16": ratio}
    _write_json(out, report)
    print(json.dumps(ratio))
    return report


def bench_flowstep(out: str, quick: bool = False, workdir: Optional[str] = None, overrides: Sequence[str] = ()) -> dict:
    """Fused Pallas flow step vs the jnp reference, same inputs, one run: max |diff| and time.

    GPU/TPU: B=8, L=1024, V=32k, d=32 (bf16 residual logits). CPU (interpreted kernel, toy
    shapes with ``--quick``) checks agreement only.
    """
    import jax
    import jax.numpy as jnp

    from kernels_pallas import flow_step as kf

    del workdir, overrides
    backend = jax.default_backend()
    interpret = backend == "cpu"
    b, length, v, d = (2, 16, 300, 32) if quick or interpret else (8, 1024, 32768, 32)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    emb = jax.random.normal(k1, (v, d))
    z = jax.random.normal(k2, (b, length, d))
    f = (3.0 * jax.random.normal(k3, (b, length, v))).astype(jnp.bfloat16)
    rows = []
    for t in (0.3, 0.9):
        tt, tn = jnp.full((b,), t), jnp.full((b,), t + 0.05)
        ref = jax.jit(lambda *a: kf.ref_flow_step(*a, c=10.0))
        ker = jax.jit(lambda *a: kf.flow_step(*a, c=10.0, interpret=interpret))
        args = (z, f, emb, tt, tn)
        r, k = jax.block_until_ready(ref(*args)), jax.block_until_ready(ker(*args))
        diff = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(r, k))
        times = {}
        for name, fn in (("reference", ref), ("kernel", ker)):
            samples = []
            for _ in range(3 if interpret else 20):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples.append(time.perf_counter() - t0)
            times[name] = float(np.median(samples))
        row = {"t": t, "batch": b, "length": length, "vocab": v, "dim": d, "max_abs_diff": diff,
               "reference_ms": times["reference"] * 1e3, "kernel_ms": times["kernel"] * 1e3,
               "speedup_kernel_over_reference": times["reference"] / times["kernel"]}
        rows.append(row)
        print(f"[bench flowstep] {backend} t={t} B={b} L={length} V={v}: max|diff| {diff:.2e}  ref "
              f"{row['reference_ms']:.3f} ms  kernel {row['kernel_ms']:.3f} ms  x{row['speedup_kernel_over_reference']:.2f}",
              flush=True)
    report = {"backend": backend, "interpret": interpret, "device": str(jax.devices()[0]), "rows": rows}
    _write_json(out, report)
    return report
