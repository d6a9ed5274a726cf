"""The corpus n-gram table proposer (`relf_jax.speculative.ngram_draft.NgramDraft`): K tokens
drawn one after another from the table's candidates for the context, like a draft model."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relf_jax.sampling import processors
from relf_jax.speculative import ngram_draft
from relf_jax.speculative.state import (
    SpecParams,
    SpecSettings,
    SpecState,
    draft_logits_scaled,
    penalties,
    sampling_knobs,
    take,
)


def propose(table: ngram_draft.NgramDraft, state: SpecState, sp: SpecParams, settings: SpecSettings, key):
    """K tokens [B, K] drawn one after another from the corpus n-gram table, and its logits
    [B, K, V] (`propose_candidates`' candidates scattered over the vocabulary)."""
    toks, cands, lps = propose_candidates(table, state, sp, settings, key)
    return toks, ngram_draft.candidate_logits(table, cands, lps)


def propose_candidates(table: ngram_draft.NgramDraft, state: SpecState, sp: SpecParams,
                       settings: SpecSettings, key):
    """K tokens [B, K] drawn one after another from the corpus n-gram table, with each
    position's candidates: token ids [B, K, M] and raw log-probabilities [B, K, M].

    Each draw runs the sampling transform over the context's M candidates, not the vocabulary:
    every other token has probability 0, so the transformed distribution is the same (top-k and
    top-p act on the same non-zero entries; greedy ties go to the lowest token id either way,
    as candidates of equal count are in id order). With `SpecParams.draft_temperature_scale` the
    log-probabilities are divided by it first, and returned so. The verifier takes the candidates as they
    are (`verify.verify_sparse`), or scattered over the vocabulary (`propose`).
    """
    c = table.order - 1
    lengths = state.lengths
    ctx = take(state.tokens, lengths[:, None] - c + jnp.arange(c)[None, :])
    valid = jnp.minimum(lengths, c)
    keys = jax.random.split(key, settings.k)
    pen = penalties(sp, state)
    knobs = sampling_knobs(sp, settings)
    toks, cands, lps = [], [], []
    for i in range(settings.k):
        cand, lp = ngram_draft.next_candidates(table, ctx, valid)
        lp = draft_logits_scaled(lp, sp)
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
