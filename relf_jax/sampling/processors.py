"""The temperature / top-k / top-p transform shared by every token-deciding sampler.

All of it runs in float32. Autoregressive sampling, speculative verification (target and draft
get the same transform) and the serving engines call `log_probs` or `sample`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -jnp.inf


def nucleus_mask(probs: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """Top-p membership: x is kept iff the mass of tokens strictly more probable than x is < top_p.

    probs: [..., V] float32 (normalised); top_p: a scalar or one value per row [...]. Returns bool [..., V]. Ties with the least probable
    kept token are all kept; top_p >= 1 keeps every token with non-zero probability.
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


def _transform(logits: jax.Array, temperature, top_k, top_p) -> tuple[jax.Array, jax.Array]:
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
    return scaled, greedy


def log_probs(logits: jax.Array, temperature: jax.Array | float = 1.0, top_k: jax.Array | int = 0,
              top_p: jax.Array | float | None = 1.0) -> jax.Array:
    """Normalised float32 log-probabilities after temperature, then top-k, then top-p.

    logits: [..., V]; each setting is a scalar or one value per row [...]. temperature 0 gives the one-hot argmax distribution (greedy); top_k 0
    and top_p 1 disable those filters. Settings may be traced scalars (no recompilation when
    they change). Removed tokens get -inf.

    A filter that is off by a Python value (``top_k=0``, ``top_p=None`` or a Python number
    >= 1) is left out at trace time: no sort is compiled. A traced setting keeps a runtime
    ``lax.cond`` -- which ``vmap`` turns into a select that always sorts when the setting is
    batched, so per-slot engines pass Python values when no slot filters.
    """
    scaled, greedy = _transform(logits, temperature, top_k, top_p)
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


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array | float = 1.0,
           top_k: jax.Array | int = 0, top_p: jax.Array | float | None = 1.0) -> jax.Array:
    """One token per row: logits [..., V] -> int32 [...], drawn from `log_probs`' distribution.
    Greedy at temperature 0 (settings as in `log_probs`).

    Inverse-CDF sampling, all float32: one uniform per row against the running sum of the
    unnormalised probabilities. That costs one random number per row instead of the V of the
    Gumbel-max trick, whose random bits and variadic argmax were a fifth of a CPU decode step.
    Each token's probability is exact up to float32 resolution (about 2**-23 of the row's mass,
    the uniform's own grid); a removed token (probability 0) is never drawn.
    """
    scaled, greedy = _transform(logits, temperature, top_k, top_p)
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
