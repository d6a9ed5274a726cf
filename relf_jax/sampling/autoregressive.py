"""Autoregressive sampling: a jitted ``lax.while_loop`` over a typed decode state.

Static settings (shapes, EOS) live on the frozen `DecodeSettings`; sampling knobs
(temperature, top-k, top-p, min-p and the `processors.Penalties`: logit bias, repetition /
frequency / presence penalties) are traced in `SamplingParams`, so changing them does not
recompile; a knob given as None is left out at trace time. The penalties' token counts live in
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

from relf_jax.config import validate_sampling
from relf_jax.errors import UserError
from relf_jax.models.causal_lm import init_cache
from relf_jax.models.layers import KVCache
from relf_jax.sampling import processors


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Static settings of one compiled sampler."""

    max_new_tokens: int
    eos_id: int
    pad_id: int = 0
    track_tokens: bool = False  # keep per-row token counts (`DecodeState.counts`) for the penalties


@flax.struct.dataclass
class SamplingParams:
    """Traced sampling knobs, a scalar or one value per row. min_p and penalties None: off
    (left out at trace time); penalties' token state (counts, seen) is ignored here: it lives
    in the `DecodeState`."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array | None = None
    penalties: processors.Penalties | None = None

    @classmethod
    def make(cls, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
             logit_bias: dict[int, float] | None = None, vocab_size: int | None = None) -> SamplingParams:
        """Settings for every row; the ones at their off value are left out. `logit_bias` needs
        `vocab_size` (its dense row is built here)."""
        validate_sampling(temperature, top_k, top_p)
        pen = processors.Penalties()
        if repetition_penalty != 1.0:
            pen = pen.replace(repetition=jnp.float32(repetition_penalty))
        if frequency_penalty:
            pen = pen.replace(frequency=jnp.float32(frequency_penalty))
        if presence_penalty:
            pen = pen.replace(presence=jnp.float32(presence_penalty))
        if logit_bias:
            if vocab_size is None:
                raise UserError("logit_bias needs the vocabulary size")
            pen = pen.replace(bias=jnp.zeros((vocab_size,), jnp.float32).at[jnp.asarray(list(logit_bias), jnp.int32)]
                              .set(jnp.asarray(list(logit_bias.values()), jnp.float32)))
        return cls(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                   jnp.float32(min_p) if min_p > 0 else None, pen if pen != processors.Penalties() else None)

    @property
    def tracks_tokens(self) -> bool:
        """Whether a penalty reads the committed tokens (the state must count them)."""
        return self.penalties is not None and self.penalties.tracks


def sample_logits(logits: jax.Array, key: jax.Array, sampling: SamplingParams, counts=None, seen=None,
                  log_probs: int = 0) -> tuple[jax.Array, jax.Array | None]:
    """(tokens [B], reported log-probs [B, 1 + 2 * log_probs] or None) for the logits [B, V] of
    one position: `processors.adjust` with the rows' token state, then `processors.sample`.
    log_probs > 0: also the drawn token's log-probability under the processed distribution and
    the `log_probs` most probable tokens (`processors.top_log_probs`)."""
    pen = sampling.penalties
    if pen is not None and counts is not None:
        pen = pen.replace(counts=counts, seen=seen)
    x = processors.adjust(logits, pen)
    tok = processors.sample(x, key, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    if not log_probs:
        return tok, None
    lp = processors.reported_log_probs(x, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return tok, processors.top_log_probs(lp, tok, log_probs)


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


def _forward(graphdef, params, tokens, positions, cache, cache_index, attend_len=None, logits_at=None):
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, cache=cache, cache_index=cache_index, attend_len=attend_len, logits_at=logits_at)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"))
def prefill(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
            sampling: SamplingParams, settings: DecodeSettings) -> DecodeState:
    """Run the padded prompts [B, P] through the model, sample each row's first new token."""
    return prefill_scored(graphdef, params, prompts, prompt_lengths, key, sampling, settings)[0]


def prefill_scored(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
                   sampling: SamplingParams, settings: DecodeSettings,
                   log_probs: int = 0) -> tuple[DecodeState, jax.Array | None]:
    """`prefill` (traceable), with the first token's reported log-probs when log_probs > 0
    (`sample_logits`)."""
    b, p = prompts.shape
    total = p + settings.max_new_tokens
    cache = init_cache(nnx.merge(graphdef, params).cfg, b, total)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    # the prompt's queries see its own slots only: skip the rest of the cache; logits at its end only
    logits, cache = _forward(graphdef, params, prompts, positions, cache, jnp.zeros((b,), jnp.int32), attend_len=p,
                             logits_at=prompt_lengths - 1)
    last = logits[:, 0]
    key, sub = jax.random.split(key)
    counts = seen = None
    if settings.track_tokens:
        counts, seen = processors.token_state(prompts, prompt_lengths, last.shape[-1])
    tok, lp = sample_logits(last, sub, sampling, counts, seen, log_probs)
    if settings.track_tokens and sampling.tracks_tokens:
        counts, seen = processors.count_tokens(counts, seen, tok[:, None])
    tokens = jnp.full((b, total), settings.pad_id, jnp.int32).at[:, :p].set(prompts)
    tokens = jax.vmap(lambda row, i, t: row.at[i].set(t))(tokens, prompt_lengths, tok)
    done = (tok == settings.eos_id) | (settings.max_new_tokens <= 1)
    return DecodeState(tokens=tokens, lengths=prompt_lengths + 1, done=done,
                       num_generated=jnp.ones((b,), jnp.int32), cache=cache, key=key,
                       step=jnp.int32(1), counts=counts, seen=seen), lp


@functools.partial(jax.jit, static_argnames=("graphdef", "settings"), donate_argnames=("state",))
def decode_step(graphdef, params, state: DecodeState, sampling: SamplingParams,
                settings: DecodeSettings) -> DecodeState:
    """Feed each row's last token, sample the next; finished rows stay unchanged."""
    return step(graphdef, params, state, sampling, settings)[0]


def step(graphdef, params, state: DecodeState, sampling: SamplingParams, settings: DecodeSettings,
         log_probs: int = 0) -> tuple[DecodeState, jax.Array | None]:
    """One decode step (traceable): feed each row's last token, sample the next (finished rows
    stay unchanged); with the new tokens' reported log-probs when log_probs > 0 (`sample_logits`)."""
    b = state.tokens.shape[0]
    pos = state.lengths - 1
    last = jnp.take_along_axis(state.tokens, pos[:, None], axis=1)
    logits, cache = _forward(graphdef, params, last, pos[:, None], state.cache, pos)
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
def _generate(graphdef, params, prompts, prompt_lengths, key, sampling, settings):
    state = prefill(graphdef, params, prompts, prompt_lengths, key, sampling, settings)
    return jax.lax.while_loop(
        lambda s: (s.step < settings.max_new_tokens) & ~jnp.all(s.done),
        lambda s: step(graphdef, params, s, sampling, settings)[0],
        state)


def _tracking(sampling: SamplingParams, settings: DecodeSettings) -> DecodeSettings:
    return dataclasses.replace(settings, track_tokens=True) if sampling.tracks_tokens else settings


def check_context(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """Raise `UserError` when prompt + reply cannot fit in the model's context."""
    if prompt_len + max_new_tokens > max_seq_len:
        raise UserError(f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} exceeds the "
                        f"model context of {max_seq_len} tokens")


def generate(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             sampling: SamplingParams, settings: DecodeSettings) -> DecodeState:
    """Sample up to ``settings.max_new_tokens`` tokens after each prompt in one jitted while_loop.

    prompts: [B, P] int32, left-aligned, padded (see `pad_prompts`); prompt_lengths: [B].
    Returns the final `DecodeState`; ``tokens[b, prompt_lengths[b]:lengths[b]]`` is row b's
    reply (ending with EOS when one was sampled). Penalties that count tokens switch on
    ``settings.track_tokens``.
    """
    settings = _tracking(sampling, settings)
    return _generate(graphdef, params, prompts, prompt_lengths, key, sampling, settings)


def stream(graphdef, params, prompts: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
           sampling: SamplingParams, settings: DecodeSettings) -> Iterator[tuple[np.ndarray, np.ndarray]]:
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
