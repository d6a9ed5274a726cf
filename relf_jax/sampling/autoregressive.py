"""Autoregressive sampling: a jitted ``lax.while_loop`` over a typed decode state.

Static settings (shapes, EOS) live on the frozen `DecodeSettings`; sampling knobs
(temperature, top-k, top-p, min-p and the `processors.Penalties`: logit bias, repetition /
frequency / presence penalties) are traced in `relf_jax.sampling.params.TracedSampling`, so
changing them does not recompile; a knob given as None is left out at trace time. The prefill is
`relf_jax.sampling.prefill`'s, shared with the speculative sampler and the export. The penalties' token counts live in
the state (``settings.track_tokens``) and are updated as tokens are committed. One compilation
per (batch, prompt bucket, max_new_tokens).

Prompts of different lengths share a batch: each row has its own length and positions; the
KV cache is preallocated for ``prompt_bucket + max_new_tokens`` slots and a query at position
p attends to slots 0..p of its row only. `stream` is the Python-loop variant for interactive
use; it calls the very same jitted prefill and step functions as `generate`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.errors import UserError
from relf_jax.models.layers import KVCache
from relf_jax.sampling import processors
from relf_jax.sampling.params import TracedSampling, sample_logits
from relf_jax.sampling.prefill import CachedPrefix, first_token, prefill_cache


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Static settings of one compiled sampler."""

    max_new_tokens: int
    eos_id: int
    pad_id: int = 0
    track_tokens: bool = False  # keep per-row token counts (`DecodeState.counts`) for the penalties

    @classmethod
    def from_tokenizer(cls, tokenizer, max_new_tokens: int, *, track_tokens: bool = False) -> DecodeSettings:
        """The settings of a model with `tokenizer` (its EOS and pad ids): `Autoregressive` has no
        fields of its own, so the tokenizer and the length are all there is to copy."""
        return cls(max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                   track_tokens=track_tokens)


@flax.struct.dataclass
class DecodeState:
    tokens: jax.Array  # [B, S] prompt followed by generated tokens, pad elsewhere
    lengths: jax.Array  # [B] tokens in each row (prompt + generated)
    done: jax.Array  # [B] bool: row has emitted EOS or hit max_new_tokens
    num_generated: jax.Array  # [B]
    cache: KVCache
    key: jax.Array
    step: jax.Array  # scalar int32: decode steps taken
    counts: jax.Array | None = None  # [B, V] int32 generated tokens per id (settings.track_tokens)
    seen: jax.Array | None = None  # [B, V] bool: the id occurs in the prompt or the reply


def prompt_bucket(length: int, minimum: int = 8) -> int:
    """Round a prompt length up to a power of two (the compile-shape bucket)."""
    b = minimum
    while b < length:
        b *= 2
    return b


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: int | None = None):
    """Left-aligned [B, bucket] int32 array and [B] lengths from ragged token lists (device arrays)."""
    arr, lens = pad_prompts_np(prompts, pad_id, bucket)
    return jnp.asarray(arr), jnp.asarray(lens)


def pad_prompts_np(prompts: Sequence[Sequence[int]], pad_id: int = 0, bucket: int | None = None):
    """`pad_prompts` as NumPy arrays: a jitted call copies them to the device with its other
    arguments, cheaper than a device array each (the serving engines' per-request prefill)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token (the BOS token)")
    longest = max(len(p) for p in prompts)
    bucket = bucket or prompt_bucket(longest)
    arr = np.full((len(prompts), bucket), pad_id, np.int32)
    for i, p in enumerate(prompts):
        arr[i, :len(p)] = p
    return arr, np.asarray([len(p) for p in prompts], np.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def prefill(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
            sampling: TracedSampling, settings: DecodeSettings) -> DecodeState:
    """Run the padded prompts [B, P] through the model, sample each row's first new token."""
    return prefill_scored(graphdef, params, prompts, prompt_lengths, key, sampling, settings)[0]


def prefill_scored(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
                   sampling: TracedSampling, settings: DecodeSettings,
                   log_probs: int = 0, prefix: CachedPrefix | None = None) -> tuple[DecodeState, jax.Array | None]:
    """`prefill` (traceable), with the first token's reported log-probs when log_probs > 0
    (`sample_logits`). prefix: the prompts' first tokens' keys and values, already in a cache of
    ``P + max_new_tokens`` slots (`relf_jax.sampling.prefill.CachedPrefix`); `prompts` is still
    the whole prompt (the token buffer and the penalties' counts start from it)."""
    b, p = prompts.shape
    total = p + settings.max_new_tokens
    last, cache = prefill_cache(nnx.merge(graphdef, params), prompts, prompt_lengths, total, prefix=prefix)
    first = first_token(last, prompts, prompt_lengths, key, sampling, total=total, pad_id=settings.pad_id,
                        eos_id=settings.eos_id, max_new_tokens=settings.max_new_tokens,
                        track_tokens=settings.track_tokens, log_probs=log_probs)
    return DecodeState(tokens=first.tokens, lengths=prompt_lengths + 1, done=first.done,
                       num_generated=jnp.ones((b,), jnp.int32), cache=cache, key=first.key,
                       step=jnp.int32(1), counts=first.counts, seen=first.seen), first.log_probs


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("state",))
def decode_step(graphdef, params, state: DecodeState, sampling: TracedSampling,
                settings: DecodeSettings) -> DecodeState:
    """Feed each row's last token, sample the next; finished rows stay unchanged."""
    return step(graphdef, params, state, sampling, settings)[0]


def step(graphdef, params, state: DecodeState, sampling: TracedSampling, settings: DecodeSettings,
         log_probs: int = 0) -> tuple[DecodeState, jax.Array | None]:
    """One decode step (traceable): feed each row's last token, sample the next (finished rows
    stay unchanged); with the new tokens' reported log-probs when log_probs > 0 (`sample_logits`)."""
    b = state.tokens.shape[0]
    pos = state.lengths - 1
    last = jnp.take_along_axis(state.tokens, pos[:, None], axis=1)
    logits, cache = nnx.merge(graphdef, params)(last, pos[:, None], cache=state.cache, cache_index=pos)
    key, sub = jax.random.split(state.key)
    tok, lp = sample_logits(logits[:, 0], sub, sampling, state.counts, state.seen, log_probs)
    active = ~state.done
    tok = jnp.where(active, tok, settings.pad_id)
    write_at = jnp.where(active, state.lengths, state.tokens.shape[1] - 1)
    cur = jnp.take_along_axis(state.tokens, write_at[:, None], axis=1)[:, 0]
    tokens = jax.vmap(lambda row, i, t: row.at[i].set(t))(state.tokens, write_at, jnp.where(active, tok, cur))
    num_generated = state.num_generated + active.astype(jnp.int32)
    done = state.done | (active & (tok == settings.eos_id)) | (num_generated >= settings.max_new_tokens)
    del b
    counts, seen = state.counts, state.seen
    if counts is not None and sampling.tracks_tokens:
        counts, seen = processors.count_tokens(counts, seen, tok[:, None], active[:, None])
    return DecodeState(tokens=tokens, lengths=state.lengths + active.astype(jnp.int32), done=done,
                       num_generated=num_generated, cache=cache, key=key, step=state.step + 1,
                       counts=counts, seen=seen), lp


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def generate_jit(graphdef, params, prompts, prompt_lengths, key, sampling, settings):
    """The jitted prefill + ``lax.while_loop`` of steps behind `generate` (settings as given, no
    penalty switch): one compilation per (graphdef, settings, shapes)."""
    state = prefill(graphdef, params, prompts, prompt_lengths, key, sampling, settings)
    return jax.lax.while_loop(
        lambda s: (s.step < settings.max_new_tokens) & ~jnp.all(s.done),
        lambda s: step(graphdef, params, s, sampling, settings)[0],
        state)


def _tracking(sampling: TracedSampling, settings: DecodeSettings) -> DecodeSettings:
    return dataclasses.replace(settings, track_tokens=True) if sampling.tracks_tokens else settings


def check_context(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """Raise `UserError` when prompt + reply cannot fit in the model's context."""
    if prompt_len + max_new_tokens > max_seq_len:
        raise UserError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the "
                        f"model context of {max_seq_len} tokens")


def generate(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             sampling: TracedSampling, settings: DecodeSettings) -> DecodeState:
    """Sample up to ``settings.max_new_tokens`` tokens after each prompt in one jitted while_loop.

    prompts: [B, P] int32, left-aligned, padded (see `pad_prompts`); prompt_lengths: [B].
    Returns the final `DecodeState`; ``tokens[b, prompt_lengths[b]:lengths[b]]`` is row b's
    reply (ending with EOS when one was sampled). Penalties that count tokens switch on
    ``settings.track_tokens``.
    """
    settings = _tracking(sampling, settings)
    return generate_jit(graphdef, params, prompts, prompt_lengths, key, sampling, settings)


def stream(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
           sampling: TracedSampling, settings: DecodeSettings) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (new_tokens [B], emitted [B] bool) after every step, via the same jitted step.

    Gives the same tokens as `generate` with the same key.
    """
    settings = _tracking(sampling, settings)
    state = prefill(graphdef, params, prompts, prompt_lengths, key, sampling, settings)
    rows = np.arange(prompts.shape[0])
    last_len = np.asarray(prompt_lengths)
    while True:
        lengths = np.asarray(state.lengths)
        toks = np.asarray(state.tokens)[rows, np.maximum(lengths - 1, 0)]
        yield toks, lengths > last_len
        last_len = lengths
        if int(state.step) >= settings.max_new_tokens or bool(np.all(np.asarray(state.done))):
            return
        state = decode_step(graphdef, params, state, sampling, settings)


def replies(state: DecodeState, prompt_lengths: jax.Array) -> list[list[int]]:
    """Each row's generated tokens as a Python list (EOS included when sampled)."""
    toks, lens, plens = np.asarray(state.tokens), np.asarray(state.lengths), np.asarray(prompt_lengths)
    return [toks[i, plens[i]:lens[i]].tolist() for i in range(toks.shape[0])]
