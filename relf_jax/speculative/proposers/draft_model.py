"""The draft-model proposer: a small AR model with the target's tokenizer drafts K tokens, one
`lax.scan` step each, from its own KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from relf_jax.sampling import processors
from relf_jax.speculative.state import (
    SpecParams,
    SpecSettings,
    SpecState,
    call_model,
    draft_logits_scaled,
    penalties,
    sampling_knobs,
    take,
)


def propose(draft_graphdef, draft_params, state: SpecState, sp: SpecParams, settings: SpecSettings, key):
    """K draft tokens and their logits [B, K], [B, K, V] from the draft model (with processed
    sampling, `SpecParams.processed`: the processed log-probs each token was drawn from), at the
    draft's own temperature scale (`SpecParams.draft_temperature_scale`)."""
    lengths = state.lengths
    pos2 = jnp.stack([lengths - 2, lengths - 1], axis=1)
    logits, cache = call_model(draft_graphdef, draft_params, take(state.tokens, pos2), pos2, state.draft_cache,
                               lengths - 2)
    first = logits[:, 1]
    keys = jax.random.split(key, settings.k)
    pen = penalties(sp, state)
    knobs = sampling_knobs(sp, settings)
    v = first.shape[-1]

    def draw(lg, k, drafted):
        """(token, the logits q it was drawn from): processed drafts count the earlier ones."""
        lg = draft_logits_scaled(lg, sp)
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
        lg, cache = call_model(draft_graphdef, draft_params, prev_tok[:, None], pos, cache, lengths + i - 1)
        tok, q = draw(lg[:, 0], keys[i], drafted)
        return (cache, tok, drafted), (tok, q)

    if settings.k > 1:
        (cache, _, _), (toks, lgs) = jax.lax.scan(body, (cache, x1, none), jnp.arange(1, settings.k))
        draft_tokens = jnp.concatenate([x1[:, None], toks.T], axis=1)
        draft_logits = jnp.concatenate([q1[:, None], jnp.moveaxis(lgs, 0, 1)], axis=1)
    else:
        draft_tokens, draft_logits = x1[:, None], q1[:, None]
    return draft_tokens, draft_logits, cache
