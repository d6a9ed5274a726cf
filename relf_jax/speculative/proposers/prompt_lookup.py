"""The prompt-lookup proposer: copy what followed the latest earlier occurrence of the context's
last n-gram (no model; a one-hot draft distribution)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relf_jax.speculative.state import SpecSettings, SpecState, take


def propose(state: SpecState, settings: SpecSettings, vocab: int):
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
            suffix_tok = take(tokens, (lengths - 1 - m)[:, None])  # [B, 1]
            shifted = jnp.roll(tokens, m, axis=1)  # shifted[:, j] = tokens[:, j - m]
            match &= (shifted == suffix_tok) & (j - m >= 0)
        match &= (j >= n - 1) & (j < (lengths - 1)[:, None]) & (lengths[:, None] > n)
        found = jnp.max(jnp.where(match, j, -1), axis=1)
        best = jnp.where(best >= 0, best, found)
    offsets = jnp.arange(1, settings.k + 1)[None, :]
    src = jnp.where(best[:, None] >= 0, best[:, None] + offsets, (lengths - 1)[:, None])
    src = jnp.minimum(src, (lengths - 1)[:, None])
    draft_tokens = take(tokens, src)
    draft_logits = jnp.where(jax.nn.one_hot(draft_tokens, vocab, dtype=bool), 0.0, -jnp.inf)
    return draft_tokens, draft_logits
