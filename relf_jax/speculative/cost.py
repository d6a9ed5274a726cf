"""What speculative decoding costs on this hardware: the target's cached forward over K + 1
tokens against one token (`forward_costs`; speculation pays off only when the first is far below
K + 1 times the second), where a round spends its time (`round_profile`), and the speedup the
standard cost model predicts from them (`expected_speedup`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.models.causal_lm import init_cache
from relf_jax.runtime.info import last_level_cache


def forward_costs(lm, k: int, batches: Sequence[int] = (1, 8), context: int = 64, reps: int = 10) -> dict:
    """Median ms of the target's cached forward over 1 token and over K + 1 tokens, per batch.

    Speculative decoding pays off only when verifying K + 1 tokens costs much less than K + 1
    one-token steps (memory-bound hardware); on a compute-bound CPU the ratio is close to K + 1.
    """
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


def decode_step_ms(lm, batch: int = 1, prompt_len: int = 16, steps: Sequence[int] = (16, 40, 64), reps: int = 7,
                   seed: int = 0) -> dict:
    """What one AR decode step costs inside the jitted decoding loop (`relf_jax.sampling.autoregressive
    .generate`, T = 1 sampling, the KV cache written), apart from the prompt's prefill and the call:
    the median wall time of a whole generation at each reply length of `steps` (EOS never ends a
    row, so each runs exactly its ``max_new_tokens``; `prompt_len` 16 is the bucket most of the
    bench's prompts take), and ``step_ms``, the slope of a line through them. ``fixed_ms`` is the
    intercept: the prefill, the first token and the call's dispatch, which a reply of n tokens
    spreads over n. Tokens/s measured on whole replies (the bench's rows) include it; the decode
    step's weight traffic is ``weight_bytes / step_ms``."""
    from relf_jax.sampling import autoregressive as ar
    from relf_jax.sampling.params import TracedSampling

    prompts, lengths = _random_prompts(lm, batch, prompt_len, seed)
    sampling = TracedSampling.make(1.0)

    def run(n):
        settings = ar.DecodeSettings(max_new_tokens=n, eos_id=-1, pad_id=lm.tokenizer.pad_id)
        state = ar.generate_jit(lm.graphdef, lm.params, prompts, lengths, jax.random.key(seed), sampling, settings)
        return state, n

    out = _slope(run, steps, reps)
    return {"batch": batch, "prompt_len": prompt_len, **{f"generate_{n}_ms": out["ms"][n] for n in steps},
            "step_ms": out["slope_ms"], "fixed_ms": out["fixed_ms"]}


def speculative_round_ms(lm, method, *, draft=None, table=None, batch: int = 1, prompt_len: int = 16,
                         steps: Sequence[int] = (16, 40, 64), reps: int = 7, temperature: float = 1.0,
                         seed: int = 0) -> dict:
    """`decode_step_ms` for speculative decoding with `method` (a `relf_jax.methods.Speculative`;
    `draft` / `table` as in `round_profile`): whole generations of the lengths `steps` (EOS never
    ends a row), their rounds counted, and ``round_ms``, the slope of the wall time over the rounds.
    ``fixed_ms`` is the intercept: the target's and the draft's prefill, the first token and the
    call, which a reply spreads over its n / tau rounds."""
    from relf_jax.speculative import generate as spec

    prompts, lengths = _random_prompts(lm, batch, prompt_len, seed)
    sp = spec.SpecParams.make(temperature, 1.0, method.nsd_top_p, method.draft_temperature_scale)
    dg, dp = (draft.graphdef, draft.params) if draft is not None else (None, table)

    def run(n):
        settings = dataclasses.replace(spec.SpecSettings.from_method(method, lm.tokenizer, n), eos_id=-1)
        state = spec.generate_jit(lm.graphdef, lm.params, dg, dp, prompts, lengths, jax.random.key(seed), sp,
                                  settings)
        return state, int(state.rounds)

    out = _slope(run, steps, reps)
    return {"batch": batch, "prompt_len": prompt_len, "k": method.k, "rounds": out["counts"],
            **{f"generate_{n}_ms": out["ms"][n] for n in steps}, "round_ms": out["slope_ms"],
            "fixed_ms": out["fixed_ms"]}


def _random_prompts(lm, batch: int, length: int, seed: int):
    prompts = np.random.default_rng(seed).integers(3, lm.model_cfg.vocab_size, (batch, length))
    return jnp.asarray(prompts, jnp.int32), jnp.full((batch,), length, jnp.int32)


def _slope(run, steps: Sequence[int], reps: int) -> dict:
    """``run(n) -> (output, units)`` timed at each n of `steps` (compiled first), round-robin over
    the lengths for `reps` rounds so a host that drifts slows every length alike: the median ms per
    length, and the least-squares line through them: ms per unit (slope) and the intercept at zero
    units."""
    counts = {}
    for n in steps:  # compile, and finish, each length before the clock starts
        out, counts[n] = run(n)
        jax.block_until_ready(out)
    times: dict[int, list[float]] = {n: [] for n in steps}
    for _ in range(reps):
        for n in steps:
            t0 = time.perf_counter()
            jax.block_until_ready(run(n)[0])
            times[n].append(time.perf_counter() - t0)
    ms = {n: 1e3 * float(np.median(times[n])) for n in steps}
    x = np.asarray([counts[n] for n in steps], np.float64)
    slope, intercept = np.polyfit(x, np.asarray([ms[n] for n in steps]), 1)
    return {"ms": ms, "counts": counts, "slope_ms": float(slope), "fixed_ms": float(intercept)}


def weight_bytes(lm) -> int:
    """Bytes of the parameters a decode step reads (all of them: the embedding table is the tied
    output projection)."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lm.params)))


def decode_regime(lm, k: int = 4, reps: int = 3) -> dict:
    """Which regime `lm`'s decode step is in on this machine, measured: its weight bytes against the
    CPU's last-level cache, and the batch-1 cost of verifying K + 1 tokens in one forward over a
    one-token step (`forward_costs`). A round that commits tau tokens for one verification is then
    at most tau / that ratio faster than AR (free drafts); speculation pays where the ratio is near
    1 (a memory-bound target), not where it is near K + 1 (compute- or overhead-bound)."""
    cost = forward_costs(lm, k, batches=(1,), reps=reps)["b1"]
    nbytes, llc = weight_bytes(lm), last_level_cache()
    return {"k": k, "weight_bytes": nbytes, "last_level_cache": None if llc is None else f"L{llc[0]}",
            "last_level_cache_bytes": None if llc is None else llc[1],
            "weights_fit_in_cache": None if llc is None else nbytes <= llc[1],
            "one_token_ms": cost["one_token_ms"], "verify_ms": cost[f"{k + 1}_tokens_ms"],
            "verify_over_one_token": cost["ratio"], "ceiling_speedup": (k + 1) / cost["ratio"]}


def _ms_per_loop(fn, args, loops: int, reps: int) -> float:
    """Median ms of one of the `loops` iterations inside `fn(*args)` (compiled first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times)) / loops


def _nudge(state, x):
    """`state` whose tokens depend on `x` (never changing them): the next loop iteration depends on
    this one, so XLA cannot hoist the work out of the loop."""
    return state.replace(tokens=state.tokens + (x > 2 ** 30).astype(jnp.int32))


def round_profile(lm, method, *, draft=None, table=None, batch: int = 1, context: int = 64, temperature: float = 1.0,
                  reps: int = 10, loops: int = 16, seed: int = 0) -> dict:
    """Where one speculative round of `method` (a `relf_jax.methods.Speculative`) spends its time on
    `lm`, for `batch` rows with `context` tokens before the round. Median ms per round of:

    - ``propose_ms``: the proposer's K drafts (`draft`: the draft model's loaded model; `table`:
      the corpus n-gram table; neither: prompt lookup);
    - ``target_forward_ms``: the target's cached forward over the last token and the K drafts
      (`score`);
    - ``verify_ms``: the rule on the target's logits (`decide`);
    - ``round_ms``: the whole round as the decoding loop runs it (`round_scored`), and
      ``bookkeeping_ms``, the round minus the three parts (committing the tokens, counters; a
      difference of medians, so it carries their noise);
    - ``one_token_ms``: a one-token target forward, the unit of AR decoding's cost.

    Each figure is `loops` calls inside one jitted fori_loop, each depending on the last (nothing
    hoisted, no dispatch) and carrying the KV caches it writes (updated in place), as inside the
    decoding loop."""
    from relf_jax.speculative import generate as spec
    from relf_jax.speculative.state import call_model

    k = method.k
    settings = spec.SpecSettings.from_method(method, lm.tokenizer, loops * (k + 1) + 8)
    sp = spec.SpecParams.make(temperature, 1.0, method.nsd_top_p, method.draft_temperature_scale)
    tg, tp = lm.graphdef, lm.params
    dg, dp = (draft.graphdef, draft.params) if draft is not None else (None, table)
    vocab = lm.model_cfg.vocab_size
    prompts = jnp.asarray(np.random.default_rng(seed).integers(3, vocab, (batch, context)), jnp.int32)
    lengths = jnp.full((batch,), context, jnp.int32)
    key = jax.random.key(seed)
    start = jax.jit(lambda p, l, kk: spec.prefill_scored(tg, tp, dg, dp, p, l, kk, sp, settings)[0])(
        prompts, lengths, key)
    proposal = jax.jit(lambda s: spec.propose(tg, tp, dg, dp, s, sp, settings, key)[:3])(start)

    def looped(body):
        return jax.jit(lambda s: jax.lax.fori_loop(0, loops, body, (s, jnp.float32(0)))[1])

    def proposing(i, carry):
        s, acc = carry
        toks, _, _, draft_cache = spec.propose(tg, tp, dg, dp, s, sp, settings, jax.random.fold_in(key, i))
        x = toks.sum().astype(jnp.float32)
        return _nudge(s.replace(draft_cache=draft_cache), x), acc + x

    def one_token(i, carry):  # an AR step's forward: one token per row
        s, acc = carry
        logits, cache = call_model(tg, tp, s.tokens[:, :1], (s.lengths - 1)[:, None], s.target_cache, s.lengths - 1)
        x = logits[:, -1, 0].sum()
        return _nudge(s.replace(target_cache=cache), x), acc + x

    def scoring(i, carry):  # the forward as the round runs it (and processing, where on)
        s, acc = carry
        logits, cache, _ = spec.score(tg, tp, s, sp, settings, proposal[0])
        x = logits[:, -1, 0].sum()
        return _nudge(s.replace(target_cache=cache), x), acc + x

    logits = jax.jit(lambda s: spec.score(tg, tp, s, sp, settings, proposal[0])[0])(start)

    def deciding(i, carry):  # the rule alone, on the round's logits
        s, acc = carry
        res = spec.decide(logits + acc * 0, proposal[0], proposal[1], proposal[2], jax.random.fold_in(key, i), sp,
                          settings)
        return s, acc + res.num_accepted.sum().astype(jnp.float32)

    def rounds(i, carry):
        s, acc = carry
        s = spec.round_scored(tg, tp, dg, dp, s, sp, settings)[0]
        return s, acc + s.lengths.sum().astype(jnp.float32)

    ms = {name: _ms_per_loop(looped(body), (start,), loops, reps) for name, body in (
        ("propose_ms", proposing), ("target_forward_ms", scoring), ("verify_ms", deciding), ("round_ms", rounds),
        ("one_token_ms", one_token))}
    ms["bookkeeping_ms"] = ms["round_ms"] - ms["propose_ms"] - ms["target_forward_ms"] - ms["verify_ms"]
    return {"k": k, "batch": batch, "context": context, **ms}


def expected_speedup(tau: float, propose_ms: float, target_forward_ms: float, one_token_ms: float) -> float:
    """Speculative over AR decoding's tokens/s as the standard cost model predicts it (Leviathan et
    al. 2023, with the verification forward's measured cost instead of one step): a round commits
    `tau` tokens (measured tokens per target forward) and costs the K drafts plus the target's
    forward over K + 1 tokens; an AR token costs one one-token forward. With c = a draft step's
    cost / a target step's and r = the (K + 1)-token forward's / a one-token forward's,
    speedup = tau / (K c + r)."""
    return tau * one_token_ms / (propose_ms + target_forward_ms)
