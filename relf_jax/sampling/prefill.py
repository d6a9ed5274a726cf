"""The one AR prefill: padded prompts through a causal LM into a fresh KV cache, and the first token.

Used by the autoregressive sampler, the speculative sampler (target and draft) and the
`jax.export` artifact. Prompts [B, P] are left-aligned and padded; each row has its own length.
The prompt's queries attend to its own P slots only (``attend_len``), and the logits are computed
at each row's last prompt token only (``logits_at``). With a `CachedPrefix` (the serving engines'
prefix cache, `relf_jax.serving.prefix_cache`) the keys and values of the prompt's first tokens
are already in the cache, and only the rest of the prompt runs through the model.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from relf_jax.models.causal_lm import init_cache
from relf_jax.sampling import processors
from relf_jax.sampling.params import TracedSampling, sample_logits


@flax.struct.dataclass
class CachedPrefix:
    """A prompt whose first `start` tokens' keys and values are already in a cache: the prefill
    runs only `suffix`, the rest of the prompt, at positions ``start + arange(T)``.

    cache: per layer (k, v) [B, K, C, Dh] (C: the prefill's `cache_len`), slots < start holding
    the prompt's keys/values; start: [B] int32; suffix: [B, T] int32 (the prompt's tokens from
    `start` on, padded), with ``start + T <= C`` (a cache write past C would be clamped onto
    earlier slots, so the caller sizes T to fit).
    """

    cache: tuple
    start: jax.Array
    suffix: jax.Array


def prefill_cache(model, prompts: jax.Array, prompt_lengths: jax.Array, cache_len: int, *,
                  logits: bool = True, prefix: CachedPrefix | None = None) -> tuple[jax.Array | None, tuple]:
    """(logits [B, V] float32 at each row's last prompt token, KV cache of `cache_len` slots
    holding the prompts). `model` is a `CausalLM` (merged). logits=False: the cache only, and the
    forward runs without ``logits_at`` (so a dynamic rope rotates each position as a decode step
    would, `CausalLM.__call__`): the speculative draft's prefill.

    prefix: the prompts' first tokens are already in ``prefix.cache`` (`CachedPrefix`); only
    ``prefix.suffix`` runs, its queries attending to the cached slots and to each other. Not for a
    dynamic rope, whose keys depend on the length of the prompt they were computed in (a
    ValueError): their cached keys would differ from a full prefill's.
    """
    if prefix is not None:
        if model.cfg.rope_scaling == "dynamic":
            raise ValueError("a cached prefix cannot be reused with a dynamic rope (its keys depend on the "
                             "prompt's length)")
        b, t = prefix.suffix.shape
        if prefix.cache[0][0].shape[2] != cache_len:
            raise ValueError(f"the cached prefix's cache holds {prefix.cache[0][0].shape[2]} slots, the prefill "
                             f"{cache_len}")
        positions = prefix.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        out, cache = model(prefix.suffix, positions, cache=prefix.cache, cache_index=prefix.start,
                           logits_at=prompt_lengths - prefix.start - 1 if logits else None)
        return (out[:, 0] if logits else None), cache
    b, p = prompts.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out, cache = model(prompts, positions, cache=init_cache(model.cfg, b, cache_len),
                       cache_index=jnp.zeros((b,), jnp.int32), attend_len=p,
                       logits_at=prompt_lengths - 1 if logits else None)
    return (out[:, 0] if logits else None), cache


@flax.struct.dataclass
class FirstToken:
    """The sampled first token committed after each prompt (`first_token`)."""

    tokens: jax.Array  # [B, total] the prompt, the first token, pad after
    done: jax.Array  # [B] the first token is EOS, or max_new_tokens <= 1
    key: jax.Array  # the key after the draw
    counts: jax.Array | None  # [B, V] token counts (track_tokens), the first token counted when a penalty reads them
    seen: jax.Array | None  # [B, V]
    log_probs: jax.Array | None  # [B, 1 + 2 * log_probs] reported log-probs (`sample_logits`) or None


def first_token(last_logits: jax.Array, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
                sampling: TracedSampling, *, total: int, pad_id: int, eos_id: int, max_new_tokens: int,
                track_tokens: bool, log_probs: int = 0) -> FirstToken:
    """Draw each row's first new token from `last_logits` [B, V] (`prefill_cache`) and write it after its
    prompt into a [B, total] token buffer. track_tokens: start the penalties' token state
    (`processors.token_state`) from the prompts."""
    b, p = prompts.shape
    key, sub = jax.random.split(key)
    counts = seen = None
    if track_tokens:
        counts, seen = processors.token_state(prompts, prompt_lengths, last_logits.shape[-1])
    tok, lp = sample_logits(last_logits, sub, sampling, counts, seen, log_probs)
    if track_tokens and sampling.tracks_tokens:
        counts, seen = processors.count_tokens(counts, seen, tok[:, None])
    tokens = jnp.full((b, total), pad_id, jnp.int32).at[:, :p].set(prompts)
    tokens = jax.vmap(lambda row, i, t: row.at[i].set(t))(tokens, prompt_lengths, tok)
    done = (tok == eos_id) | (max_new_tokens <= 1)
    return FirstToken(tokens=tokens, done=done, key=key, counts=counts, seen=seen, log_probs=lp)
