"""The one plain-jnp reference of speculative verification: every decision, written once.

`ref_verify` takes vocabulary-wide draft logits (the semantics the Pallas kernel in
`kernels_pallas.verify` reproduces exactly); `ref_verify_sparse` takes a draft whose
distribution at each position lives on M candidates (the corpus n-gram table's) and makes the
same decisions from the same pieces: `accept_drafts` (the standard / NSD test and the leading
run), `greedy_verify`, and `emit` (the residual or bonus sample by an exponential `race`).

Randomness is an input: uniforms [B, K] for the acceptance tests, Exp(1) noise [B, V] for the
one sample per row. Everything that decides a token is float32. Kernels import only JAX, so
the sampling transform is mirrored here (`ref_log_probs`, `ref_nucleus_mask`, `first_argmax`
mirror `relf_jax.sampling.processors`); callers pass theirs as `log_probs_fn`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

RULES = ("standard", "nsd", "greedy")


def validate_inputs(target_logits, draft_logits, draft_tokens, uniforms=None, exponentials=None,
                    *, rule: str = "standard") -> tuple[int, int, int]:
    """Checks shapes, dtypes and the rule name; returns (B, K, V). Raises ValueError."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    for name, x, ndim in (("target_logits", target_logits, 3), ("draft_logits", draft_logits, 3),
                          ("draft_tokens", draft_tokens, 2)):
        if jnp.ndim(x) != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {jnp.shape(x)}")
    b, k1, v = target_logits.shape
    k = k1 - 1
    if k < 1:
        raise ValueError("target_logits must have K+1 >= 2 positions, got shape "
                         f"{target_logits.shape}")
    if v < 1:
        raise ValueError(f"vocabulary size must be >= 1, got shape {target_logits.shape}")
    if draft_logits.shape != (b, k, v):
        raise ValueError(f"draft_logits must have shape (B, K, V) = {(b, k, v)} to match "
                         f"target_logits {target_logits.shape}, got {draft_logits.shape}")
    if draft_tokens.shape != (b, k):
        raise ValueError(f"draft_tokens must have shape (B, K) = {(b, k)}, "
                         f"got {draft_tokens.shape}")
    for name, x in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(f"draft_tokens must be integer token ids, got {draft_tokens.dtype}")
    _validate_noise(uniforms, exponentials, b, k, v)
    return b, k, v


def _validate_noise(uniforms, exponentials, b: int, k: int, v: int) -> None:
    for name, x, shape in (("uniforms", uniforms, (b, k)), ("exponentials", exponentials, (b, v))):
        if x is None:
            continue
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")


# ----------------------------------------------------------------------------- the transform


def ref_nucleus_mask(probs: jax.Array, top_p) -> jax.Array:
    """Top-p membership by sorting: x kept iff the mass strictly above p(x) is < top_p.

    probs [..., V] float32 -> bool [..., V]. Mirrors relf_jax.sampling.processors.nucleus_mask
    (kernels import no relf_jax). The most probable token is always kept; top_p >= 1 keeps the
    support.
    """
    probs = probs.astype(jnp.float32)
    descending = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(descending, axis=-1) - descending
    n_keep = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
    threshold = jnp.take_along_axis(descending, n_keep - 1, axis=-1)
    return jnp.where(jnp.asarray(top_p) >= 1.0, probs > 0, probs >= threshold)


def ref_log_probs(logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """float32 log-probs after temperature -> top-k -> top-p; temperature 0 = one-hot argmax.

    logits [..., V] -> [..., V], removed tokens -inf; scalar settings. Mirrors
    relf_jax.sampling.processors.log_probs operation for operation: top_k 0 and top_p >= 1 skip
    their filter entirely (top_p >= 1 removes nothing, not even zero-probability tokens).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    v = logits.shape[-1]
    k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)

    def keep_top_k(x):
        kth_index = jnp.broadcast_to(jnp.clip(k - 1, 0, v - 1), x.shape[:-1] + (1,))
        kth = jnp.take_along_axis(-jnp.sort(-x, axis=-1), kth_index, axis=-1)
        return jnp.where((k > 0) & (x < kth), -jnp.inf, x)

    def keep_nucleus(x):
        return jnp.where(ref_nucleus_mask(jax.nn.softmax(x, axis=-1), top_p), x, -jnp.inf)

    scaled = lax.cond(k > 0, keep_top_k, lambda x: x, scaled)
    scaled = lax.cond(top_p < 1.0, keep_nucleus, lambda x: x, scaled)
    out = jax.nn.log_softmax(scaled, axis=-1)
    is_argmax = jax.nn.one_hot(first_argmax(logits), v, dtype=jnp.bool_)
    one_hot = jnp.where(is_argmax, 0.0, -jnp.inf)
    return jnp.where(greedy, one_hot, out)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` for NaN-free x (first index on ties) as a max and a min over
    indices: plain reductions, ~3x faster than XLA:CPU's variadic argmax reduce at [8, 5, 1024].
    (`relf_jax.sampling.processors.first_argmax` is the same; kernels import only JAX.)"""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1), x.shape[-1] - 1)


# ----------------------------------------------------------------------------- the decisions


def race(weights: jax.Array, exponentials: jax.Array) -> jax.Array:
    """Exponential race: argmax_v w_v / E_v over w_v > 0 (first index on ties) ~ norm(w)."""
    keys = jnp.where(weights > 0, weights / exponentials, -1.0)
    return first_argmax(keys)


def leading_run(accept: jax.Array) -> jax.Array:
    """[B, K] bool -> [B] int32: the number of accepts before the first rejection."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def nucleus_member(probs: jax.Array, p_x: jax.Array, top_p) -> jax.Array:
    """Is the token with probability p_x in the top-p nucleus of probs [..., V]? -> bool [...].

    The membership test of `ref_nucleus_mask` for one token, without a sort: x is in the
    nucleus iff the mass of tokens strictly more probable than x is < top_p (top_p >= 1: any
    token with p_x > 0). One masked sum over V, the same the kernel computes.
    """
    above = jnp.sum(jnp.where(probs > p_x[..., None], probs, 0.0), axis=-1)
    is_max = p_x >= jnp.max(probs, axis=-1)
    return jnp.where(jnp.asarray(top_p) >= 1.0, p_x > 0.0, (above < top_p) | is_max)


def greedy_verify(target: jax.Array, tokens: jax.Array):
    """The greedy rule: x_i accepted iff it is the argmax of the raw target logits [B, K+1, V]
    at i; the emitted token is the argmax at the first rejection (or at K).
    Returns (num_accepted [B], next_token [B], accept [B, K])."""
    k = tokens.shape[1]
    target_argmax = first_argmax(target)  # [B, K+1]
    accept = tokens == target_argmax[:, :k]
    num = leading_run(accept)
    return num, jnp.take_along_axis(target_argmax, num[:, None], axis=1)[:, 0], accept


def accept_drafts(p_draft: jax.Array, p_x: jax.Array, q_x: jax.Array, uniforms: jax.Array, rule: str,
                  nsd_top_p):
    """The standard test u_i * q_i(x_i) < p_i(x_i) (P = min(1, p/q), no division), OR-ed with
    nucleus membership under NSD. p_draft [B, K, V]; p_x, q_x, uniforms [B, K].
    Returns (accept [B, K] bool, num_accepted [B] int32)."""
    accept = uniforms * q_x < p_x
    if rule == "nsd":
        accept = accept | nucleus_member(p_draft, p_x, nsd_top_p)
    return accept, leading_run(accept)


def emit(p_n: jax.Array, residual_n: jax.Array, num: jax.Array, k: int, residual_floor,
         exponentials: jax.Array) -> jax.Array:
    """The emitted token [B]: a sample of the residual residual_n [B, V] when a draft was rejected
    (num < k) and its mass is >= residual_floor, else of p_n [B, V] (the target at the emitted
    position: p_K, the bonus, when all K were accepted)."""
    enough = jnp.sum(residual_n, axis=-1, keepdims=True) >= residual_floor
    chosen = jnp.where((num < k)[:, None] & enough, residual_n, p_n)
    return race(chosen, exponentials)


def _distributions(target_logits, draft_logits, temperature, top_k, top_p, log_probs_fn):
    """(p, q) float32: the target's and the draft's logits through the same transform
    (`log_probs_fn`, default `ref_log_probs`), exponentiated."""
    log_probs_fn = ref_log_probs if log_probs_fn is None else log_probs_fn
    p = jnp.exp(log_probs_fn(target_logits.astype(jnp.float32), temperature, top_k, top_p))
    q = jnp.exp(log_probs_fn(draft_logits.astype(jnp.float32), temperature, top_k, top_p))
    return p, q


def ref_verify(target_logits: jax.Array, draft_logits: jax.Array, draft_tokens: jax.Array,
               uniforms: jax.Array, exponentials: jax.Array, *, rule: str = "standard",
               temperature=1.0, top_k: int = 0, top_p=1.0, nsd_top_p=0.9, residual_floor=1e-8,
               log_probs_fn: Callable | None = None):
    """Plain-jnp verification; the semantics the kernel must reproduce exactly.

    Args:
      target_logits: [B, K+1, V] (any float dtype; cast to float32 first).
      draft_logits: [B, K, V].
      draft_tokens: [B, K] int, in [0, V).
      uniforms: [B, K] U[0, 1) noise; draft i accepted (standard) iff u_i * q_i(x_i) < p_i(x_i).
      exponentials: [B, V] Exp(1) noise for the emitted token's race.
      rule: "standard" | "nsd" (standard OR x_i in the nsd_top_p nucleus of p_i, see
        `nucleus_member`) | "greedy"
        (x_i == argmax of the raw target logits; emitted token is that argmax).
      log_probs_fn: the transform (logits, temperature, top_k, top_p) -> log-probs; defaults
        to this module's mirror of `relf_jax.sampling.processors.log_probs`.
    Returns:
      (num_accepted [B] int32, next_token [B] int32, accept [B, K] bool).
    """
    _, k, _ = validate_inputs(target_logits, draft_logits, draft_tokens, uniforms, exponentials,
                              rule=rule)
    tokens = draft_tokens.astype(jnp.int32)
    if rule == "greedy":
        return greedy_verify(target_logits.astype(jnp.float32), tokens)
    p, q = _distributions(target_logits, draft_logits, temperature, top_k, top_p, log_probs_fn)  # [B, K(+1), V]
    p_draft = p[:, :k]
    p_x = jnp.take_along_axis(p_draft, tokens[..., None], axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, tokens[..., None], axis=-1)[..., 0]
    accept, num = accept_drafts(p_draft, p_x, q_x, uniforms.astype(jnp.float32), rule, nsd_top_p)
    # the emitted position n only: p_n (p_K when all K were accepted) and its residual
    p_n = jnp.take_along_axis(p, num[:, None, None], axis=1)[:, 0]  # [B, V]
    q_n = jnp.take_along_axis(q, jnp.minimum(num, k - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    return num, emit(p_n, residual, num, k, residual_floor, exponentials.astype(jnp.float32)), accept


def ref_verify_sparse(target_logits: jax.Array, cand_ids: jax.Array, cand_logits: jax.Array,
                      draft_tokens: jax.Array, uniforms: jax.Array, exponentials: jax.Array, *,
                      rule: str = "standard", temperature=1.0, top_k: int = 0, top_p=1.0, nsd_top_p=0.9,
                      residual_floor=1e-8, log_probs_fn: Callable | None = None):
    """`ref_verify` for a draft whose distribution at each position lives on M candidates.

    cand_ids [B, K, M] token ids and cand_logits [B, K, M] raw logits (-inf on padding; a padded
    entry may repeat a candidate's id): the draft logits are these scattered over the
    vocabulary, and the decisions are `ref_verify`'s on those, up to float rounding. The draft's
    transform runs over M entries instead of V, and the residual norm(max(0, p - q)) is built
    at the emitted position only, p with its candidates lowered. Other arguments as `ref_verify`.
    """
    b, k1, v = target_logits.shape
    k = draft_tokens.shape[1]
    if rule not in RULES or k1 != k + 1 or cand_ids.shape[:2] != (b, k) or cand_logits.shape != cand_ids.shape:
        raise ValueError(f"verify_sparse: rule {rule!r}, target {target_logits.shape}, drafts {draft_tokens.shape}, "
                         f"candidates {cand_ids.shape} / {cand_logits.shape}")
    _validate_noise(uniforms, exponentials, b, k, v)
    x = draft_tokens.astype(jnp.int32)
    if rule == "greedy":
        return greedy_verify(target_logits.astype(jnp.float32), x)
    p, q = _distributions(target_logits, cand_logits, temperature, top_k, top_p, log_probs_fn)  # q: [B, K, M]
    ids = cand_ids.astype(jnp.int32)
    p_draft = p[:, :k]
    p_x = jnp.take_along_axis(p_draft, x[..., None], axis=-1)[..., 0]
    q_x = jnp.max(jnp.where(ids == x[..., None], q, 0.0), axis=-1)  # padding repeats ids with q = 0
    accept, num = accept_drafts(p_draft, p_x, q_x, uniforms, rule, nsd_top_p)
    p_n = jnp.take_along_axis(p, num[:, None, None], axis=1)[:, 0]  # [B, V]
    row = jnp.minimum(num, k - 1)[:, None, None]
    ids_n, q_n = jnp.take_along_axis(ids, row, axis=1)[:, 0], jnp.take_along_axis(q, row, axis=1)[:, 0]  # [B, M]
    lowered = jnp.maximum(jnp.take_along_axis(p_n, ids_n, axis=-1) - q_n, 0.0)
    # scatter-min: a padded entry (q = 0) leaves p, never overriding its id's real candidate
    residual = jax.vmap(lambda r, i, val: r.at[i].min(val))(p_n, ids_n, lowered)
    return num, emit(p_n, residual, num, k, residual_floor, exponentials), accept
