"""The logits processors shared by every token-deciding sampler.

All of it runs in float32. Autoregressive sampling, speculative verification (target and draft
get the same transform) and the serving engines call `adjust` (logit-level processors), then
`log_probs` or `sample` (temperature and the filters).

The order is transformers' (`GenerationMixin._get_logits_processor`: its logit processors, then
its warpers), with OpenAI's frequency/presence penalties after the repetition penalty as vLLM
applies them:

1. ``logit_bias``: a bias added per token (transformers' `SequenceBiasLogitsProcessor` with
   one-token sequences);
2. ``repetition_penalty`` r over every token seen in the prompt or the reply so far:
   logit / r where the logit is > 0, logit * r otherwise (`RepetitionPenaltyLogitsProcessor`);
3. ``frequency_penalty`` f and ``presence_penalty`` e over the reply's tokens (OpenAI):
   logit - count * f - (count > 0) * e;
4. temperature; 5. top-k; 6. top-p; 7. ``min_p``: keep tokens with p >= min_p * p_max
   (`MinPLogitsWarper`: after temperature, top-k and top-p; the probability ratio is the same
   before and after their renormalisation).

A processor that is off is given as ``None`` (or a Python value that disables it) and is then
left out at trace time: it costs nothing.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


def nucleus_mask(probs: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """Top-p membership: x is kept iff the mass of tokens strictly more probable than x is < top_p.

    probs: [..., V] float32 (normalised); top_p: a scalar or one value per row [...]. Returns bool
    [..., V]. Ties with the least probable kept token are all kept; top_p >= 1 keeps every token
    with non-zero probability.
    """
    probs = probs.astype(jnp.float32)
    top_p = jnp.expand_dims(jnp.asarray(top_p, jnp.float32), -1)  # scalar or per row [...]
    p_sorted = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(p_sorted, axis=-1) - p_sorted  # exclusive cumulative sum
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(p_sorted, n_keep - 1, axis=-1)
    keep = probs >= threshold
    return jnp.where(top_p >= 1.0, probs > 0, keep)


def first_argmax(x: jax.Array) -> jax.Array:
    """Index of the first maximum along the last axis: int32 [...] from x [..., V] (NaN-free).

    Equal to ``jnp.argmax(x, -1)`` (ties: the first index; all -inf: 0), computed as a max
    and a min over indices: two plain reductions, where XLA:CPU lowers argmax to one
    variadic reduce that ran ~3x slower on the [B, K+1, V] logits of a verification round.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # stays in range even for a NaN row


def static_off(value, off) -> bool:
    """True when `value` is a Python/NumPy number (not traced) for which `off` holds."""
    if isinstance(value, (bool, int, float, np.integer, np.floating)):
        return bool(off(value))
    return False


@flax.struct.dataclass
class Penalties:
    """The logit-level processors of a batch of rows, with the token state they read.

    Settings, one value per row [...] (None: off for every row, left out at trace time):
    bias [..., V] float32 (added to the logits); repetition [...] (1 = off); frequency and
    presence [...] (0 = off). State: counts [..., V] int32 (times each token was generated so
    far) and seen [..., V] bool (the token occurs in the prompt or the reply), updated with
    `commit` as tokens are committed; None when no penalty needs them.
    """

    bias: jax.Array | None = None
    repetition: jax.Array | None = None
    frequency: jax.Array | None = None
    presence: jax.Array | None = None
    counts: jax.Array | None = None
    seen: jax.Array | None = None

    @property
    def tracks(self) -> bool:
        """Whether some penalty reads the token state (so `commit` must update it)."""
        return any(x is not None for x in (self.repetition, self.frequency, self.presence))

    def off(self, bias: bool = False, penalties: bool = False) -> Penalties:
        """Self with the bias and / or the penalties dropped (Python flags: None fields)."""
        out = self
        if bias:
            out = out.replace(bias=None)
        if penalties:
            out = out.replace(repetition=None, frequency=None, presence=None)
        return out

    def commit(self, tokens: jax.Array, mask: jax.Array | None = None) -> Penalties:
        """The state after committing `tokens` [..., n] int32 (where `mask` [..., n] is True):
        counts + 1 and seen for each. A no-op when no penalty reads the state."""
        if not self.tracks or self.counts is None:
            return self
        counts, seen = count_tokens(self.counts, self.seen, tokens, mask)
        return self.replace(counts=counts, seen=seen)


def count_tokens(counts: jax.Array, seen: jax.Array, tokens: jax.Array,
                 mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(counts, seen) [..., V] after committing `tokens` [..., n] (where `mask` [..., n] holds)."""
    hot = jax.nn.one_hot(tokens, counts.shape[-1], dtype=jnp.int32)
    if mask is not None:
        hot = hot * mask[..., None].astype(jnp.int32)
    added = jnp.sum(hot, axis=-2)
    return counts + added, seen | (added > 0)


def token_state(prompts: jax.Array, lengths: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """Initial (counts [B, V] int32 zeros, seen [B, V] bool) for prompts [B, P] of `lengths` [B]."""
    b, p = prompts.shape
    valid = jnp.arange(p)[None, :] < lengths[:, None]
    seen = jnp.zeros((b, vocab), bool)
    seen = jax.vmap(lambda row, t, m: row.at[t].max(m))(seen, prompts, valid)
    return jnp.zeros((b, vocab), jnp.int32), seen


def adjust(logits: jax.Array, pen: Penalties | None, extra_counts: jax.Array | None = None) -> jax.Array:
    """float32 logits [..., V] after logit_bias, the repetition penalty and the frequency /
    presence penalties of `pen` (its rows broadcast against the leading axes of `logits`).

    extra_counts [..., V] int32: tokens committed beyond ``pen.counts`` (a speculative round's
    earlier drafts at each position), counted as generated and seen. None fields cost nothing.
    """
    x = logits.astype(jnp.float32)
    if pen is None:
        return x
    lead = x.ndim - 1

    def row(a):  # [...] settings against x's leading axes
        a = jnp.asarray(a, jnp.float32)
        return a.reshape(a.shape + (1,) * (lead - a.ndim + 1))

    def vec(a):  # [..., V] per-row vectors against x's leading axes
        return a.reshape(a.shape[:-1] + (1,) * (x.ndim - a.ndim) + a.shape[-1:])

    if pen.bias is not None:
        x = x + vec(pen.bias.astype(jnp.float32))
    if not pen.tracks:
        return x
    counts = vec(pen.counts)
    seen = vec(pen.seen)
    if extra_counts is not None:
        counts = counts + extra_counts
        seen = seen | (extra_counts > 0)
    if pen.repetition is not None:
        r = row(pen.repetition)
        x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    if pen.frequency is not None:
        x = x - counts.astype(jnp.float32) * row(pen.frequency)
    if pen.presence is not None:
        x = x - (counts > 0).astype(jnp.float32) * row(pen.presence)
    return x


def _transform(logits: jax.Array, temperature, top_k, top_p, min_p=None) -> tuple[jax.Array, jax.Array]:
    """(scaled logits with removed tokens at -inf [..., V] float32, greedy [..., 1] bool)."""
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = (temperature <= 0)[..., None]
    scaled = logits / jnp.where(greedy, 1.0, temperature[..., None])
    v = logits.shape[-1]
    skip_top_k = static_off(top_k, lambda x: x <= 0)
    skip_top_p = top_p is None or static_off(top_p, lambda x: x >= 1.0)
    k = jnp.asarray(0 if skip_top_k else top_k, jnp.int32)
    top_p = jnp.asarray(1.0 if skip_top_p else top_p, jnp.float32)

    def keep_top_k(x):
        kth_index = jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1)[..., None], x.shape[:-1] + (1,))
        kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), kth_index, axis=-1)
        return jnp.where((k[..., None] > 0) & (x < kth), NEG_INF, x)

    def keep_nucleus(x):
        return jnp.where(nucleus_mask(jax.nn.softmax(x, axis=-1), top_p), x, NEG_INF)

    # Sorting is costly on CPU: skip a filter when no row uses it (settings may be per row).
    if not skip_top_k:
        scaled = jax.lax.cond(jnp.any(k > 0), keep_top_k, lambda x: x, scaled)
    if not skip_top_p:
        scaled = jax.lax.cond(jnp.any(top_p < 1.0), keep_nucleus, lambda x: x, scaled)
    if not (min_p is None or static_off(min_p, lambda x: x <= 0)):
        # after top-k / top-p, as transformers' MinPLogitsWarper: p >= min_p * p_max
        probs = jax.nn.softmax(scaled, axis=-1)
        floor = jnp.expand_dims(jnp.asarray(min_p, jnp.float32), -1) * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs >= floor, scaled, NEG_INF)
    return scaled, greedy


def log_probs(logits: jax.Array, temperature: jax.Array | float = 1.0, top_k: jax.Array | int = 0,
              top_p: jax.Array | float | None = 1.0, min_p: jax.Array | float | None = None) -> jax.Array:
    """Normalised float32 log-probabilities after temperature, then top-k, top-p and min-p.

    logits: [..., V]; each setting is a scalar or one value per row [...]. temperature 0 gives
    the one-hot argmax distribution (greedy); top_k 0, top_p 1 and min_p 0 (or None) disable
    those filters. Settings may be traced scalars (no recompilation when
    they change). Removed tokens get -inf.

    A filter that is off by a Python value (``top_k=0``, ``top_p=None`` or a Python number
    >= 1) is left out at trace time: no sort is compiled. A traced setting keeps a runtime
    ``lax.cond`` -- which ``vmap`` turns into a select that always sorts when the setting is
    batched, so per-slot engines pass Python values when no slot filters.
    """
    scaled, greedy = _transform(logits, temperature, top_k, top_p, min_p)
    out = jax.nn.log_softmax(scaled, axis=-1)
    v = logits.shape[-1]

    def with_greedy_rows(out):
        one_hot = jnp.where(jax.nn.one_hot(first_argmax(logits), v, dtype=jnp.bool_), 0.0, NEG_INF)
        return jnp.where(greedy, one_hot, out)

    if static_off(temperature, lambda t: t > 0):
        return out
    # the greedy rows' one-hot costs a pass over [..., V]: only when some row is greedy (a
    # `vmap` with batched temperatures turns this into a select that always computes it)
    return jax.lax.cond(jnp.any(greedy), with_greedy_rows, lambda out: out, out)


def running_sum(w: jax.Array, block: int = 32) -> jax.Array:
    """Inclusive cumulative sum over the last axis of w [..., V] float32, as two small
    triangular matmuls (within blocks of `block`, then over the block totals), at HIGHEST
    precision. Same values as ``jnp.cumsum`` up to float32 rounding; on CPU half its cost (XLA
    lowers cumsum to a reduce-window there)."""
    v = w.shape[-1]
    nb = -(-v // block)
    w = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (w.ndim - 1) + [(0, nb * block - v)])
    w = w.reshape(w.shape[:-1] + (nb, block))
    inner = jnp.einsum("...ij,jk->...ik", w, jnp.triu(jnp.ones((block, block), jnp.float32)),
                       precision=jax.lax.Precision.HIGHEST)
    start = jnp.einsum("...j,jk->...k", inner[..., -1], jnp.triu(jnp.ones((nb, nb), jnp.float32), 1),
                       precision=jax.lax.Precision.HIGHEST)  # exclusive prefix of block totals
    return (inner + start[..., None]).reshape(w.shape[:-2] + (nb * block,))[..., :v]


def reported_log_probs(logits: jax.Array, temperature: jax.Array | float = 1.0, top_k: jax.Array | int = 0,
                       top_p: jax.Array | float | None = 1.0, min_p: jax.Array | float | None = None) -> jax.Array:
    """The log-probabilities an API reports for tokens drawn from `log_probs`' distribution:
    that distribution, except at temperature 0 (greedy, one-hot), where it is the softmax of
    `logits` (the distribution whose argmax was taken). logits: [..., V] after `adjust`."""
    out = log_probs(logits, temperature, top_k, top_p, min_p)
    if static_off(temperature, lambda t: t > 0):
        return out
    greedy = (jnp.asarray(temperature, jnp.float32) <= 0)[..., None]
    return jnp.where(greedy, jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), out)


def top_log_probs(lp: jax.Array, tokens: jax.Array, n: int) -> jax.Array:
    """The token's log-prob and the `n` most probable tokens: float32 [..., 1 + 2n] =
    (lp[token], the n ids as float32, their n log-probs, most probable first).

    lp [..., V]; tokens [...] int32. Ids are exact in float32 below 2**24 (vocabularies are)."""
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)
    vals, ids = jax.lax.top_k(lp, n)
    return jnp.concatenate([chosen, ids.astype(jnp.float32), vals], axis=-1)


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array | float = 1.0,
           top_k: jax.Array | int = 0, top_p: jax.Array | float | None = 1.0,
           min_p: jax.Array | float | None = None) -> jax.Array:
    """One token per row: logits [..., V] -> int32 [...], drawn from `log_probs`' distribution.
    Greedy at temperature 0 (settings as in `log_probs`).

    Inverse-CDF sampling, all float32: one uniform per row against the running sum of the
    unnormalised probabilities. That costs one random number per row instead of the V of the
    Gumbel-max trick, whose random bits and variadic argmax were a fifth of a CPU decode step.
    Each token's probability is exact up to float32 resolution (about 2**-23 of the row's mass,
    the uniform's own grid); a removed token (probability 0) is never drawn.
    """
    scaled, greedy = _transform(logits, temperature, top_k, top_p, min_p)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    # Greedy rows use the same search: weight 1 on the maxima and r = 0 pick the first maximum,
    # as argmax would, without a second (variadic, slow on CPU) reduce.
    weights = jnp.where(greedy, (scaled == top).astype(jnp.float32), jnp.exp(scaled - top))  # max weight 1
    cdf = running_sum(weights)
    total = cdf[..., -1:]
    u = jnp.where(greedy, 0.0, jax.random.uniform(key, total.shape, jnp.float32))
    # u < 1, but u * total may round up to total: stay below it so some token always follows
    r = jnp.minimum(u * total, jnp.nextafter(total, jnp.float32(0)))
    return jnp.sum(cdf <= r, axis=-1).astype(jnp.int32)  # the first index whose cumulative weight exceeds r
