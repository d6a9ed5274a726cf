"""Speculative generation: one jitted ``lax.while_loop`` over draft/verify rounds.

Each round, for every row of the batch at once:

1. the proposer (`relf_jax.speculative.proposers`, one module each) drafts K tokens: a small AR
   draft model run as a ``lax.scan``; prompt lookup: copy what followed the latest earlier
   occurrence of the context's last n-gram; or a corpus n-gram table,
   `relf_jax.speculative.ngram_draft`, sampled like a draft model;
2. the target scores the last committed token and the K drafts in ONE forward pass
   (K + 1 positions);
3. `verify` (standard / NSD / greedy rule) keeps a prefix of n drafts and emits one more
   token (the residual sample at the first rejection, or the bonus token);
4. the row commits n + 1 tokens: its length grows by its own count.

Caches are fixed-size and never rolled back by copying: a row's length is the truth. A query
at position p sees cache slots 0..p only, so slots written for rejected drafts are masked and
overwritten on the next round. The draft re-reads the last two committed tokens each round,
which refreshes the one slot (the last draft token) it never wrote when all K were accepted.

Static settings live on the frozen `SpecSettings`; sampling knobs are traced (`SpecParams`); both
and the `SpecState` are defined in `relf_jax.speculative.state`.
With ``trace_top_k > 0`` every round is recorded in the state (`relf_jax.speculative.trace`).

The logits processors beyond temperature / top-k / top-p (a per-row top-k, min-p, logit bias,
repetition / frequency / presence penalties: `relf_jax.sampling.processors`) apply to the
target's distribution at every verified position, with the token counts of the committed
tokens plus the drafts before that position, and the same transform to the draft model's
(and the n-gram table's) distribution as it drafts. Verification then runs on the processed
log-probabilities (temperature 1, no filters), so the standard rule stays exact for the
processed target distribution.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import dispatch
from relf_jax.errors import UserError
from relf_jax.sampling import processors
from relf_jax.sampling.params import TracedSampling
from relf_jax.sampling.prefill import CachedPrefix, first_token, prefill_cache
from relf_jax.speculative import ngram_draft
from relf_jax.speculative.proposers import draft_model, ngram_table, prompt_lookup
from relf_jax.speculative.state import (
    SpecParams,
    SpecSettings,
    SpecState,
    call_model,
    penalties,
    sampling_knobs,
    take,
    temperature_for,
)
from relf_jax.speculative.trace import empty_trace, record_round
from relf_jax.speculative.verify import verify, verify_sparse


def _drafted_counts(draft_tokens: jax.Array, vocab: int) -> jax.Array:
    """[B, K+1, V] int32: at verified position i (the target's logits after feeding the last
    committed token and drafts[:i]), the counts of draft_tokens[:, :i]."""
    hot = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros_like(hot[:, :1]), jnp.cumsum(hot, axis=1)], axis=1)


def sparse_verify(settings: SpecSettings) -> bool:
    """Whether the n-gram proposer's drafts are verified as candidates (`verify.verify_sparse`):
    wherever the reference path runs; the Pallas kernel takes vocabulary-wide draft logits."""
    return settings.proposer == "corpus_ngram" and not dispatch.runs_verify_kernel(settings.use_kernel, settings.top_k)


def propose(target_graphdef, target_params, draft_graphdef, draft_params, state: SpecState, sp: SpecParams,
             settings: SpecSettings, key):
    """The round's K draft tokens [B, K] from the settings' proposer: (draft_tokens, draft_logits
    [B, K, V] or None, candidates or None, draft_cache). The corpus n-gram table's drafts come as
    candidates (ids [B, K, M], logits [B, K, M]) where they are verified sparse (`sparse_verify`)."""
    if settings.proposer == "draft":
        draft_tokens, draft_logits, draft_cache = draft_model.propose(draft_graphdef, draft_params, state, sp, settings,
                                                                 key)
        return draft_tokens, draft_logits, None, draft_cache
    if settings.proposer == "corpus_ngram":
        if sparse_verify(settings):
            draft_tokens, cands, cand_logits = ngram_table.propose_candidates(draft_params, state, sp, settings, key)
            return draft_tokens, None, (cands, cand_logits), state.draft_cache
        draft_tokens, draft_logits = ngram_table.propose(draft_params, state, sp, settings, key)
        return draft_tokens, draft_logits, None, state.draft_cache
    vocab = nnx.merge(target_graphdef, target_params).cfg.vocab_size
    draft_tokens, draft_logits = prompt_lookup.propose(state, settings, vocab)
    return draft_tokens, draft_logits, None, state.draft_cache


def score(target_graphdef, target_params, state: SpecState, sp: SpecParams, settings: SpecSettings, draft_tokens):
    """The target's one forward over the last committed token and the K drafts. Returns (the
    logits to verify (processed: log-probs), target_cache, the target's logits as scored
    (processed: adjusted))."""
    lengths = state.lengths
    last = take(state.tokens, (lengths - 1)[:, None])
    feed = jnp.concatenate([last, draft_tokens], axis=1)  # [B, K+1]
    positions = (lengths - 1)[:, None] + jnp.arange(settings.k + 1)[None, :]
    target_logits, target_cache = call_model(target_graphdef, target_params, feed, positions, state.target_cache,
                                             lengths - 1)
    scored = target_logits
    if sp.processed:
        # the target's processed distribution at position j counts drafts[:j] as committed
        pen = penalties(sp, state)
        drafted = (_drafted_counts(draft_tokens, target_logits.shape[-1])
                   if pen is not None and pen.tracks else None)
        scored = processors.adjust(target_logits, pen, drafted)
        target_logits = processors.log_probs(scored, *sampling_knobs(sp, settings))
    return target_logits, target_cache, scored


def decide(target_logits, draft_tokens, draft_logits, candidates, key, sp: SpecParams, settings: SpecSettings):
    """The verification rule on `score`'s logits: `verify`, or `verify_sparse` on the n-gram
    table's candidates (unscattered)."""
    rules = {"rule": settings.rule, "temperature": sp.temperature, "top_k": settings.top_k, "top_p": sp.top_p,
             "nsd_top_p": sp.nsd_top_p}
    if sp.processed:  # both sides are processed log-probs: the rule alone (temperature 1, no filters)
        rules.update(temperature=1.0, top_k=0, top_p=None)
    if candidates is not None:
        return verify_sparse(target_logits, *candidates, draft_tokens, key, **rules)
    return verify(target_logits, draft_logits, draft_tokens, key, use_kernel=settings.use_kernel, **rules)


def score_and_verify(target_graphdef, target_params, state: SpecState, sp: SpecParams, settings: SpecSettings,
                     draft_tokens, draft_logits, candidates, key):
    """`score`, then `decide`. Returns (VerifyResult, target_cache, the target's logits as scored
    (processed: adjusted), the logits verified (processed: log-probs))."""
    target_logits, target_cache, scored = score(target_graphdef, target_params, state, sp, settings, draft_tokens)
    res = decide(target_logits, draft_tokens, draft_logits, candidates, key, sp, settings)
    return res, target_cache, scored, target_logits


def _committed(state: SpecState, res, draft_tokens, settings: SpecSettings):
    """What each row commits: (cand [B, K+1] the accepted drafts then the emitted token, count [B]
    committed tokens (cut after EOS, at max_new_tokens, 0 for done rows), first_eos [B])."""
    k = settings.k
    n = res.num_accepted
    idx = jnp.arange(k + 1)[None, :]
    cand = jnp.concatenate([draft_tokens, jnp.full_like(draft_tokens[:, :1], settings.pad_id)], axis=1)
    cand = jnp.where(idx == n[:, None], res.next_token[:, None], cand)
    count = n + 1
    is_eos = (cand == settings.eos_id) & (idx < count[:, None])
    first_eos = jnp.min(jnp.where(is_eos, idx, k + 1), axis=1)
    count = jnp.minimum(count, first_eos + 1)
    count = jnp.minimum(count, settings.max_new_tokens - state.num_generated)
    return cand, jnp.where(~state.done, count, 0), first_eos


def _write(tokens, lengths, cand, count, k: int):
    """Write each row's first `count` of cand [B, K+1] at its length."""
    def write(row, start, new, c):
        old = jax.lax.dynamic_slice(row, (start,), (k + 1,))
        return jax.lax.dynamic_update_slice(row, jnp.where(jnp.arange(k + 1) < c, new, old), (start,))

    return jax.vmap(write)(tokens, lengths, cand, count)


def round_scored(target_graphdef, target_params, draft_graphdef, draft_params, state: SpecState, sp: SpecParams,
                 settings: SpecSettings, log_probs: int = 0) -> tuple[SpecState, jax.Array | None]:
    """One draft/verify round (traceable): the new state; with log_probs > 0 also
    [B, K+1, 1 + 2 * log_probs]: at each of the K+1 positions, the token committed there (where
    one was) under the target's processed distribution at that position and its `log_probs` most
    probable tokens (`processors.top_log_probs` of `processors.reported_log_probs`)."""
    k = settings.k
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    lengths = state.lengths
    draft_tokens, draft_logits, candidates, draft_cache = propose(
        target_graphdef, target_params, draft_graphdef, draft_params, state, sp, settings, k_draft)
    res, target_cache, scored, target_logits = score_and_verify(
        target_graphdef, target_params, state, sp, settings, draft_tokens, draft_logits, candidates, k_verify)
    n = res.num_accepted
    cand, count, first_eos = _committed(state, res, draft_tokens, settings)
    active = ~state.done
    num_generated = state.num_generated + count
    counts, seen = state.counts, state.seen
    if counts is not None and sp.penalties is not None and sp.penalties.tracks:
        counts, seen = processors.count_tokens(counts, seen, cand, jnp.arange(k + 1)[None, :] < count[:, None])
    lp = None
    if log_probs:
        reported = processors.reported_log_probs(scored, *sampling_knobs(sp, settings))
        lp = processors.top_log_probs(reported, cand, log_probs)
    done = state.done | (active & (first_eos < count)) | (num_generated >= settings.max_new_tokens)
    trace = state.trace
    if settings.trace_top_k:
        trace = record_round(trace, state.rounds, start=lengths, active=active, draft_tokens=draft_tokens,
                             accept=res.accept, num_accepted=n, next_token=res.next_token, count=count,
                             target_logits=target_logits,  # processed: already log-probs, transformed
                             temperature=1.0 if sp.processed else temperature_for(sp, settings),
                             top_k=0 if sp.processed else settings.top_k, top_p=None if sp.processed else sp.top_p)
    act = active.astype(jnp.int32)
    accepted_at = state.accepted_at + jnp.sum((n[:, None] > jnp.arange(k)[None, :]) & active[:, None], axis=0)
    return SpecState(tokens=_write(state.tokens, lengths, cand, count, k), lengths=lengths + count, done=done,
                     num_generated=num_generated, target_cache=target_cache, draft_cache=draft_cache, key=key,
                     rounds=state.rounds + 1, target_forwards=state.target_forwards + act,
                     accepted=state.accepted + jnp.where(active, jnp.minimum(n, count), 0),
                     accepted_at=accepted_at.astype(jnp.int32),
                     active_rounds=state.active_rounds + jnp.sum(act), trace=trace, counts=counts, seen=seen), lp


def prefill_scored(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths, key,
                   sp: SpecParams, settings: SpecSettings, log_probs: int = 0, prefix: CachedPrefix | None = None,
                   draft_prefix_cache: tuple | None = None) -> tuple[SpecState, jax.Array | None]:
    """The prompts' prefill (`relf_jax.sampling.prefill`: the target's, and the draft model's
    cache) and first token (traceable): the first state; with log_probs > 0 also the first
    token's reported log-probs [B, 1 + 2 * log_probs] (`round_scored`). prefix: the prompts'
    first tokens' keys and values already in the target's cache (`CachedPrefix`), and with a
    draft model in `draft_prefix_cache`, the draft's, at the same positions; `prompts` is still
    the whole prompt."""
    b, p = prompts.shape
    total = p + settings.max_new_tokens + settings.k + 1
    target = nnx.merge(target_graphdef, target_params)
    last, tcache = prefill_cache(target, prompts, prompt_lengths, total, prefix=prefix)
    dcache = ()
    if settings.proposer == "draft":
        dprefix = None if prefix is None else prefix.replace(cache=draft_prefix_cache)
        _, dcache = prefill_cache(nnx.merge(draft_graphdef, draft_params), prompts, prompt_lengths, total,
                                  logits=False, prefix=dprefix)
    t, top_k, top_p, min_p = sampling_knobs(sp, settings)
    first = first_token(last, prompts, prompt_lengths, key, TracedSampling(t, top_k, top_p, min_p, sp.penalties),
                        total=total, pad_id=settings.pad_id, eos_id=settings.eos_id,
                        max_new_tokens=settings.max_new_tokens, track_tokens=settings.track_tokens,
                        log_probs=log_probs)
    trace = (empty_trace(settings.max_new_tokens, b, settings.k, min(settings.trace_top_k, target.cfg.vocab_size))
             if settings.trace_top_k else ())
    return SpecState(tokens=first.tokens, lengths=prompt_lengths + 1, done=first.done,
                     num_generated=jnp.ones((b,), jnp.int32), target_cache=tcache, draft_cache=dcache, key=first.key,
                     rounds=jnp.int32(0), target_forwards=jnp.ones((b,), jnp.int32),
                     accepted=jnp.zeros((b,), jnp.int32), accepted_at=jnp.zeros((settings.k,), jnp.int32),
                     active_rounds=jnp.int32(0), trace=trace, counts=first.counts, seen=first.seen), first.log_probs


@functools.partial(jax.jit, static_argnames=("target_graphdef", "draft_graphdef", "settings"))
def generate_jit(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths, key, sp,
                 settings):
    """The jitted prefill + ``lax.while_loop`` of rounds behind `generate` (settings as given, no
    checks): one compilation per (graphdefs, settings, shapes)."""
    state = prefill_scored(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths,
                           key, sp, settings)[0]
    return jax.lax.while_loop(
        lambda s: (s.rounds < settings.max_new_tokens) & ~jnp.all(s.done),
        lambda s: round_scored(target_graphdef, target_params, draft_graphdef, draft_params, s, sp, settings)[0],
        state)


def generate(target_graphdef, target_params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             sp: SpecParams, settings: SpecSettings, draft_graphdef=None, draft_params=None) -> SpecState:
    """Speculative sampling of up to ``settings.max_new_tokens`` tokens after each prompt.

    prompts: [B, P] int32 left-aligned and padded; prompt_lengths: [B]. The draft model (same
    tokenizer as the target) is needed for a draft-model proposer (settings.proposer "draft", the tag
    `SpecSettings.from_method` gives `DraftModel`); an `NgramTable` proposer ("corpus_ngram") takes
    an `NgramDraft` table as `draft_params` (draft_graphdef None). Returns the final `SpecState`:
    ``tokens[b, prompt_lengths[b]:lengths[b]]`` is row b's reply; `stats` summarises it.
    """
    if settings.proposer == "draft" and draft_graphdef is None:
        raise UserError("proposer 'draft' needs a draft model (draft_graphdef, draft_params)")
    if settings.proposer == "corpus_ngram":
        check_ngram_table(draft_params, nnx.merge(target_graphdef, target_params).cfg.vocab_size)
    if sp.penalties is not None and sp.penalties.tracks and not settings.track_tokens:
        settings = dataclasses.replace(settings, track_tokens=True)
    return generate_jit(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths, key,
                        sp, settings)


def check_ngram_table(table, vocab_size: int) -> None:
    """A clear error unless `table` is an `NgramDraft` over the target's vocabulary."""
    if not isinstance(table, ngram_draft.NgramDraft):
        raise UserError("proposer 'corpus_ngram' needs an NgramDraft table as draft_params "
                        "(relf_jax.speculative.ngram_draft.build_ngram_draft)")
    if table.vocab_size != vocab_size:
        raise UserError(f"the n-gram table covers {table.vocab_size} tokens, the target {vocab_size}")


def stats(state: SpecState) -> dict:
    """tau (tokens per target forward), acceptance rate per draft position, rounds."""
    import numpy as np

    gen = np.asarray(state.num_generated).sum()
    fwd = np.asarray(state.target_forwards).sum()
    act = max(int(state.active_rounds), 1)
    return {"tau": float(gen / max(fwd, 1)), "tokens": int(gen), "target_forwards": int(fwd),
            "rounds": int(state.rounds), "mean_accepted": float(np.asarray(state.accepted).sum() / act),
            "acceptance_at": (np.asarray(state.accepted_at) / act).tolist()}
