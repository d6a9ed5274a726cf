"""Speculative generation: one jitted ``lax.while_loop`` over draft/verify rounds.

Each round, for every row of the batch at once:

1. the proposer drafts K tokens (a small AR draft model run as a ``lax.scan``; prompt
   lookup: copy what followed the latest earlier occurrence of the context's last n-gram; or
   a corpus n-gram table, `relf_jax.speculative.ngram_draft`, sampled like a draft model);
2. the target scores the last committed token and the K drafts in ONE forward pass
   (K + 1 positions);
3. `verify` (standard / NSD / greedy rule) keeps a prefix of n drafts and emits one more
   token (the residual sample at the first rejection, or the bonus token);
4. the row commits n + 1 tokens: its length grows by its own count.

Caches are fixed-size and never rolled back by copying: a row's length is the truth. A query
at position p sees cache slots 0..p only, so slots written for rejected drafts are masked and
overwritten on the next round. The draft re-reads the last two committed tokens each round,
which refreshes the one slot (the last draft token) it never wrote when all K were accepted.

Static settings live on the frozen `SpecSettings`; sampling knobs are traced (`SpecParams`).
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

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from kernels_pallas import dispatch
from relf_jax.config import validate_sampling
from relf_jax.errors import UserError
from relf_jax.sampling import processors
from relf_jax.sampling.params import SamplingParams
from relf_jax.sampling.prefill import first_token, prefill_cache
from relf_jax.speculative import ngram_draft
from relf_jax.speculative.trace import empty_trace, record_round
from relf_jax.speculative.verify import RULES, verify, verify_sparse

PROPOSERS = ("draft", "prompt_lookup", "corpus_ngram")


@dataclasses.dataclass(frozen=True)
class SpecSettings:
    """Static settings of one compiled speculative sampler."""

    k: int = 4
    rule: str = "standard"
    proposer: str = "draft"
    max_new_tokens: int = 64
    eos_id: int = 1
    pad_id: int = 0
    ngram: int = 3  # prompt lookup: longest n-gram to match
    top_k: int = 0  # static: the verification kernel has no top-k, so it selects the code path
    use_kernel: bool | None = None
    trace_top_k: int = 0  # > 0: record every round (`relf_jax.speculative.trace`) with the target's top-T
    track_tokens: bool = False  # keep per-row token counts (`SpecState.counts`) for the penalties

    def __post_init__(self):
        if self.k < 1:
            raise UserError(f"speculative k must be >= 1, got {self.k}")
        if self.rule not in RULES:
            raise UserError(f"unknown verification rule {self.rule!r}; choose one of: {', '.join(RULES)}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0, got {self.top_k}")
        if self.proposer not in PROPOSERS:
            raise UserError(f"unknown proposer {self.proposer!r}; choose one of: {', '.join(PROPOSERS)}")
        if self.trace_top_k < 0:
            raise UserError(f"trace_top_k must be >= 0, got {self.trace_top_k}")


@flax.struct.dataclass
class SpecParams:
    """Traced sampling knobs. The shared top_k is static, on `SpecSettings`; a traced per-row
    `top_k`, `min_p` and `penalties` (`processors.Penalties`; their token state lives in the
    `SpecState`) are None when off, and switch the round to processed verification (module
    docstring)."""

    temperature: jax.Array
    top_p: jax.Array
    nsd_top_p: jax.Array
    top_k: jax.Array | None = None
    min_p: jax.Array | None = None
    penalties: processors.Penalties | None = None

    @property
    def processed(self) -> bool:
        """Whether the round verifies processed log-probabilities (some extra processor is on)."""
        pen = self.penalties
        return self.top_k is not None or self.min_p is not None or (
            pen is not None and (pen.bias is not None or pen.tracks))

    @classmethod
    def make(cls, temperature=1.0, top_p=1.0, nsd_top_p=0.9) -> SpecParams:
        validate_sampling(temperature, 0, top_p)
        if not 0 < nsd_top_p <= 1:
            raise UserError(f"nsd_top_p must be in (0, 1], got {nsd_top_p}")
        return cls(jnp.float32(temperature), jnp.float32(top_p), jnp.float32(nsd_top_p))


@flax.struct.dataclass
class SpecState:
    tokens: jax.Array  # [B, S]
    lengths: jax.Array  # [B] committed tokens per row
    done: jax.Array  # [B]
    num_generated: jax.Array  # [B]
    target_cache: tuple
    draft_cache: tuple  # () for prompt lookup and the corpus n-gram table
    key: jax.Array
    rounds: jax.Array  # scalar: rounds run
    target_forwards: jax.Array  # [B] target forward passes while the row was active (prefill included)
    accepted: jax.Array  # [B] accepted draft tokens
    accepted_at: jax.Array  # [K] active rounds whose accepted prefix reached position i
    active_rounds: jax.Array  # scalar: sum over rows of active rounds
    trace: object = ()  # a `RoundTrace` when settings.trace_top_k > 0, else ()
    counts: jax.Array | None = None  # [B, V] int32 generated tokens per id (settings.track_tokens)
    seen: jax.Array | None = None  # [B, V] bool: the id occurs in the prompt or the reply


def _temperature(sp: SpecParams, settings: SpecSettings):
    """The greedy rule emits argmax tokens only, so its first token and drafts are greedy too."""
    return jnp.float32(0.0) if settings.rule == "greedy" else sp.temperature


def _knobs(sp: SpecParams, settings: SpecSettings) -> tuple:
    """(temperature, top_k, top_p, min_p) of `processors.log_probs` / `sample`."""
    return (_temperature(sp, settings), settings.top_k if sp.top_k is None else sp.top_k, sp.top_p, sp.min_p)


def _penalties(sp: SpecParams, state: SpecState) -> processors.Penalties | None:
    """The request's penalties with the state's token counts (None when none is on)."""
    pen = sp.penalties
    if pen is None or (pen.bias is None and not pen.tracks):
        return None
    return pen.replace(counts=state.counts, seen=state.seen) if pen.tracks else pen


def _drafted_counts(draft_tokens: jax.Array, vocab: int) -> jax.Array:
    """[B, K+1, V] int32: at verified position i (the target's logits after feeding the last
    committed token and drafts[:i]), the counts of draft_tokens[:, :i]."""
    hot = jax.nn.one_hot(draft_tokens, vocab, dtype=jnp.int32)
    return jnp.concatenate([jnp.zeros_like(hot[:, :1]), jnp.cumsum(hot, axis=1)], axis=1)


def sparse_verify(settings: SpecSettings) -> bool:
    """Whether the n-gram proposer's drafts are verified as candidates (`verify.verify_sparse`):
    wherever the reference path runs; the Pallas kernel takes vocabulary-wide draft logits."""
    return settings.proposer == "corpus_ngram" and not dispatch.runs_verify_kernel(settings.use_kernel, settings.top_k)


def _forward(graphdef, params, tokens, positions, cache, index, attend_len=None, logits_at=None):
    return nnx.merge(graphdef, params)(tokens, positions, cache=cache, cache_index=index, attend_len=attend_len,
                                       logits_at=logits_at)


def _take(tokens, positions):
    return jnp.take_along_axis(tokens, jnp.clip(positions, 0, tokens.shape[1] - 1), axis=1)


def _propose_draft(draft_graphdef, draft_params, state: SpecState, sp: SpecParams, settings: SpecSettings, key):
    """K draft tokens and their logits [B, K], [B, K, V] from the draft model (with processed
    sampling, `SpecParams.processed`: the processed log-probs each token was drawn from)."""
    lengths = state.lengths
    pos2 = jnp.stack([lengths - 2, lengths - 1], axis=1)
    logits, cache = _forward(draft_graphdef, draft_params, _take(state.tokens, pos2), pos2, state.draft_cache,
                             lengths - 2)
    first = logits[:, 1]
    keys = jax.random.split(key, settings.k)
    pen = _penalties(sp, state)
    knobs = _knobs(sp, settings)
    v = first.shape[-1]

    def draw(lg, k, drafted):
        """(token, the logits q it was drawn from): processed drafts count the earlier ones."""
        if not sp.processed:
            return processors.sample(lg, k, *knobs), lg
        x = processors.adjust(lg, pen, drafted if pen is not None and pen.tracks else None)
        return processors.sample(x, k, *knobs), processors.log_probs(x, *knobs)

    none = jnp.zeros((first.shape[0], v), jnp.int32)
    x1, q1 = draw(first, keys[0], none)

    def body(carry, i):
        cache, prev_tok, drafted = carry
        drafted = drafted + jax.nn.one_hot(prev_tok, v, dtype=jnp.int32)
        pos = (lengths + i - 1)[:, None]
        lg, cache = _forward(draft_graphdef, draft_params, prev_tok[:, None], pos, cache, lengths + i - 1)
        tok, q = draw(lg[:, 0], keys[i], drafted)
        return (cache, tok, drafted), (tok, q)

    if settings.k > 1:
        (cache, _, _), (toks, lgs) = jax.lax.scan(body, (cache, x1, none), jnp.arange(1, settings.k))
        draft_tokens = jnp.concatenate([x1[:, None], toks.T], axis=1)
        draft_logits = jnp.concatenate([q1[:, None], jnp.moveaxis(lgs, 0, 1)], axis=1)
    else:
        draft_tokens, draft_logits = x1[:, None], q1[:, None]
    return draft_tokens, draft_logits, cache


def _propose_lookup(state: SpecState, settings: SpecSettings, vocab: int):
    """Prompt lookup: copy the K tokens after the latest earlier match of the last n-gram.

    Tries n = settings.ngram down to 1; with no match it proposes the last token again. The
    proposal is deterministic, so its distribution q is one-hot.
    """
    tokens, lengths = state.tokens, state.lengths
    b, s = tokens.shape
    j = jnp.arange(s)[None, :]  # candidate end position of an earlier n-gram occurrence
    best = jnp.full((b,), -1, jnp.int32)
    for n in range(settings.ngram, 0, -1):
        match = jnp.ones((b, s), bool)
        for m in range(n):
            suffix_tok = _take(tokens, (lengths - 1 - m)[:, None])  # [B, 1]
            shifted = jnp.roll(tokens, m, axis=1)  # shifted[:, j] = tokens[:, j - m]
            match &= (shifted == suffix_tok) & (j - m >= 0)
        match &= (j >= n - 1) & (j < (lengths - 1)[:, None]) & (lengths[:, None] > n)
        found = jnp.max(jnp.where(match, j, -1), axis=1)
        best = jnp.where(best >= 0, best, found)
    offsets = jnp.arange(1, settings.k + 1)[None, :]
    src = jnp.where(best[:, None] >= 0, best[:, None] + offsets, (lengths - 1)[:, None])
    src = jnp.minimum(src, (lengths - 1)[:, None])
    draft_tokens = _take(tokens, src)
    draft_logits = jnp.where(jax.nn.one_hot(draft_tokens, vocab, dtype=bool), 0.0, -jnp.inf)
    return draft_tokens, draft_logits


def _propose_ngram(table: ngram_draft.NgramDraft, state: SpecState, sp: SpecParams, settings: SpecSettings, key):
    """K tokens [B, K] drawn one after another from the corpus n-gram table, and its logits
    [B, K, V] (`_propose_ngram_candidates`' candidates scattered over the vocabulary)."""
    toks, cands, lps = _propose_ngram_candidates(table, state, sp, settings, key)
    return toks, ngram_draft.candidate_logits(table, cands, lps)


def _propose_ngram_candidates(table: ngram_draft.NgramDraft, state: SpecState, sp: SpecParams,
                              settings: SpecSettings, key):
    """K tokens [B, K] drawn one after another from the corpus n-gram table, with each
    position's candidates: token ids [B, K, M] and raw log-probabilities [B, K, M].

    Each draw runs the sampling transform over the context's M candidates, not the vocabulary:
    every other token has probability 0, so the transformed distribution is the same (top-k and
    top-p act on the same non-zero entries; greedy ties go to the lowest token id either way,
    as candidates of equal count are in id order). The verifier takes the candidates as they
    are (`verify.verify_sparse`), or scattered over the vocabulary (`_propose_ngram`).
    """
    c = table.order - 1
    lengths = state.lengths
    ctx = _take(state.tokens, lengths[:, None] - c + jnp.arange(c)[None, :])
    valid = jnp.minimum(lengths, c)
    keys = jax.random.split(key, settings.k)
    pen = _penalties(sp, state)
    knobs = _knobs(sp, settings)
    toks, cands, lps = [], [], []
    for i in range(settings.k):
        cand, lp = ngram_draft.next_candidates(table, ctx, valid)
        if sp.processed:  # the processors on the M candidates (gathered bias and counts); q as log-probs
            if pen is not None:
                def at(x, cand=cand):  # [V] or [B, V] -> [B, M]
                    return jnp.take_along_axis(jnp.broadcast_to(x, (cand.shape[0], x.shape[-1])), cand, axis=-1)

                sub = pen.replace(bias=None if pen.bias is None else at(pen.bias))
                if pen.tracks:
                    earlier = (jnp.sum(cand[:, :, None] == jnp.stack(toks, axis=1)[:, None, :], axis=-1) if toks
                               else jnp.zeros_like(cand))
                    sub = sub.replace(counts=at(pen.counts) + earlier, seen=at(pen.seen) | (earlier > 0))
                lp = processors.adjust(lp, sub)
            pick = processors.sample(lp, keys[i], *knobs)
            lp = processors.log_probs(lp, *knobs)
        else:
            pick = processors.sample(lp, keys[i], *knobs)
        tok = jnp.take_along_axis(cand, pick[:, None], axis=1)[:, 0]
        toks.append(tok)
        cands.append(cand)
        lps.append(lp)
        ctx = jnp.concatenate([ctx[:, 1:], tok[:, None]], axis=1)
        valid = jnp.minimum(valid + 1, c)
    return jnp.stack(toks, axis=1), jnp.stack(cands, axis=1), jnp.stack(lps, axis=1)


def _propose(target_graphdef, target_params, draft_graphdef, draft_params, state: SpecState, sp: SpecParams,
             settings: SpecSettings, key):
    """The round's K draft tokens [B, K] from the settings' proposer: (draft_tokens, draft_logits
    [B, K, V] or None, candidates or None, draft_cache). The corpus n-gram table's drafts come as
    candidates (ids [B, K, M], logits [B, K, M]) where they are verified sparse (`sparse_verify`)."""
    if settings.proposer == "draft":
        draft_tokens, draft_logits, draft_cache = _propose_draft(draft_graphdef, draft_params, state, sp, settings,
                                                                 key)
        return draft_tokens, draft_logits, None, draft_cache
    if settings.proposer == "corpus_ngram":
        if sparse_verify(settings):
            draft_tokens, cands, cand_logits = _propose_ngram_candidates(draft_params, state, sp, settings, key)
            return draft_tokens, None, (cands, cand_logits), state.draft_cache
        draft_tokens, draft_logits = _propose_ngram(draft_params, state, sp, settings, key)
        return draft_tokens, draft_logits, None, state.draft_cache
    vocab = nnx.merge(target_graphdef, target_params).cfg.vocab_size
    draft_tokens, draft_logits = _propose_lookup(state, settings, vocab)
    return draft_tokens, draft_logits, None, state.draft_cache


def _score_and_verify(target_graphdef, target_params, state: SpecState, sp: SpecParams, settings: SpecSettings,
                      draft_tokens, draft_logits, candidates, key):
    """The target's one forward over the last committed token and the K drafts, then `verify`
    (or `verify_sparse` on candidates). Returns (VerifyResult, target_cache, the target's logits
    as scored (processed: adjusted), the logits verified (processed: log-probs))."""
    lengths = state.lengths
    last = _take(state.tokens, (lengths - 1)[:, None])
    feed = jnp.concatenate([last, draft_tokens], axis=1)  # [B, K+1]
    positions = (lengths - 1)[:, None] + jnp.arange(settings.k + 1)[None, :]
    target_logits, target_cache = _forward(target_graphdef, target_params, feed, positions, state.target_cache,
                                           lengths - 1)
    rules = {"rule": settings.rule, "temperature": sp.temperature, "top_k": settings.top_k, "top_p": sp.top_p,
             "nsd_top_p": sp.nsd_top_p}
    scored = target_logits
    if sp.processed:
        # the target's processed distribution at position j counts drafts[:j] as committed
        pen = _penalties(sp, state)
        drafted = (_drafted_counts(draft_tokens, target_logits.shape[-1])
                   if pen is not None and pen.tracks else None)
        scored = processors.adjust(target_logits, pen, drafted)
        target_logits = processors.log_probs(scored, *_knobs(sp, settings))
        # both sides are processed log-probs now: the rule alone (temperature 1, no filters)
        rules.update(temperature=1.0, top_k=0, top_p=None)
    if candidates is not None:  # the n-gram table's candidates, unscattered
        res = verify_sparse(target_logits, *candidates, draft_tokens, key, **rules)
    else:
        res = verify(target_logits, draft_logits, draft_tokens, key, use_kernel=settings.use_kernel, **rules)
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
    draft_tokens, draft_logits, candidates, draft_cache = _propose(
        target_graphdef, target_params, draft_graphdef, draft_params, state, sp, settings, k_draft)
    res, target_cache, scored, target_logits = _score_and_verify(
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
        lp = processors.top_log_probs(processors.reported_log_probs(scored, *_knobs(sp, settings)), cand, log_probs)
    done = state.done | (active & (first_eos < count)) | (num_generated >= settings.max_new_tokens)
    trace = state.trace
    if settings.trace_top_k:
        trace = record_round(trace, state.rounds, start=lengths, active=active, draft_tokens=draft_tokens,
                             accept=res.accept, num_accepted=n, next_token=res.next_token, count=count,
                             target_logits=target_logits,  # processed: already log-probs, transformed
                             temperature=1.0 if sp.processed else _temperature(sp, settings),
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
                   sp: SpecParams, settings: SpecSettings, log_probs: int = 0) -> tuple[SpecState, jax.Array | None]:
    """The prompts' prefill (`relf_jax.sampling.prefill`: the target's, and the draft model's
    cache) and first token (traceable): the first state; with log_probs > 0 also the first
    token's reported log-probs [B, 1 + 2 * log_probs] (`round_scored`)."""
    b, p = prompts.shape
    total = p + settings.max_new_tokens + settings.k + 1
    target = nnx.merge(target_graphdef, target_params)
    last, tcache = prefill_cache(target, prompts, prompt_lengths, total)
    dcache = ()
    if settings.proposer == "draft":
        _, dcache = prefill_cache(nnx.merge(draft_graphdef, draft_params), prompts, prompt_lengths, total,
                                  logits=False)
    t, top_k, top_p, min_p = _knobs(sp, settings)
    first = first_token(last, prompts, prompt_lengths, key, SamplingParams(t, top_k, top_p, min_p, sp.penalties),
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
def _generate(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths, key, sp,
              settings):
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
    tokenizer as the target) is needed for ``proposer="draft"``; ``proposer="corpus_ngram"`` takes
    an `NgramDraft` table as `draft_params` (draft_graphdef None). Returns the final `SpecState`:
    ``tokens[b, prompt_lengths[b]:lengths[b]]`` is row b's reply; `stats` summarises it.
    """
    if settings.proposer == "draft" and draft_graphdef is None:
        raise UserError("proposer 'draft' needs a draft model (draft_graphdef, draft_params)")
    if settings.proposer == "corpus_ngram":
        check_ngram_table(draft_params, nnx.merge(target_graphdef, target_params).cfg.vocab_size)
    if sp.penalties is not None and sp.penalties.tracks and not settings.track_tokens:
        settings = dataclasses.replace(settings, track_tokens=True)
    return _generate(target_graphdef, target_params, draft_graphdef, draft_params, prompts, prompt_lengths, key,
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
