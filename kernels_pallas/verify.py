"""Speculative-decoding verification as one Pallas kernel, with its plain-jnp reference.

For every batch row the kernel transforms the target's K+1 and the draft's K logit rows
(temperature, then top-p), decides each draft token under the standard, NSD or greedy rule,
cuts at the first rejection and emits one token: a sample of the residual norm(max(0, p - q))
at the first rejection (p itself when the residual mass is below `residual_floor`), or the
bonus token from the target's last row when all K drafts are accepted.

Randomness is an input, never drawn here: uniforms [B, K] for the acceptance tests and
Exp(1) noise [B, V] for the one sample per row (exponential race: the token is
argmax_v w_v / E_v over w_v > 0, which is distributed as norm(w)). The kernel and `ref_verify`
therefore make identical decisions for identical noise.

Kernel layout: a grid over blocks of `block_b` batch rows; each program holds its rows' logits
and loops over the K+1 positions and, inside, over the vocabulary in tiles of `block_v`
(normalisers by a running max + sum-exp). V is padded to a multiple of `block_v` with -inf
logits, so padded tokens have probability 0 and are never chosen.

Top-p without a sort: x is kept iff the mass of tokens strictly more probable than x is
< top_p (ties with the least probable kept token are all kept; the most probable token is always
kept) -- the same set as the sort-based `ref_nucleus_mask`; top_p >= 1 skips the filter, like
`ref_log_probs`. The kept set is {x : p(x) >= t0} with t0 the smallest probability t for which
mass_above(t) = sum_{p(y) > t} p(y) is < top_p. The kernel finds t0 by bisection on the int32 bit
patterns of non-negative float32s (ordered like the values): `NUCLEUS_BISECTION_STEPS` = 32
passes, each a masked sum over the V tiles. Since the search interval starts below 2**30
patterns, after at most 31 halvings it holds a single float, so t0 is found exactly; the only
possible difference from the sort is float rounding of the two mass sums (a token whose
mass_above lies within a few ulp of top_p), a measure-zero event for continuous logits.
For the NSD rule only the draft token's membership is needed: one masked sum, no bisection.

Not supported by the kernel: top_k > 0 (use `ref_verify`; `verify` raises).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

RULES = ("standard", "nsd", "greedy")
NUCLEUS_BISECTION_STEPS = 32
_NUM_SETTINGS = 4  # temperature, top_p, nsd_top_p, residual_floor
_BIG_INDEX = 2**30


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the verify kernel: `block_b` batch rows per program, vocabulary tiles of
    `block_v` (use powers of two; a multiple of 128 on TPU)."""

    block_b: int = 1
    block_v: int = 512

    def __post_init__(self):
        for name in ("block_b", "block_v"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


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
    for name, x, shape in (("uniforms", uniforms, (b, k)), ("exponentials", exponentials, (b, v))):
        if x is None:
            continue
        if jnp.shape(x) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {jnp.shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
    return b, k, v


# ----------------------------------------------------------------------------- reference


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
    is_argmax = jax.nn.one_hot(_first_argmax(logits), v, dtype=jnp.bool_)
    one_hot = jnp.where(is_argmax, 0.0, -jnp.inf)
    return jnp.where(greedy, one_hot, out)


def _first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, -1)`` for NaN-free x (first index on ties) as a max and a min over
    indices: plain reductions, ~3x faster than XLA:CPU's variadic argmax reduce at [8, 5, 1024].
    (`relf_jax.sampling.processors.first_argmax` is the same; kernels import only JAX.)"""
    top = jnp.max(x, axis=-1, keepdims=True)
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1), x.shape[-1] - 1)


def _race(weights: jax.Array, exponentials: jax.Array) -> jax.Array:
    """Exponential race: argmax_v w_v / E_v over w_v > 0 (first index on ties) ~ norm(w)."""
    keys = jnp.where(weights > 0, weights / exponentials, -1.0)
    return _first_argmax(keys)


def _leading_run(accept: jax.Array) -> jax.Array:
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
    log_probs_fn = ref_log_probs if log_probs_fn is None else log_probs_fn
    target = target_logits.astype(jnp.float32)
    draft = draft_logits.astype(jnp.float32)
    tokens = draft_tokens.astype(jnp.int32)[..., None]
    target_argmax = _first_argmax(target)  # [B, K+1]

    if rule == "greedy":
        accept = tokens[..., 0] == target_argmax[:, :k]
        num = _leading_run(accept)
        return num, jnp.take_along_axis(target_argmax, num[:, None], axis=1)[:, 0], accept

    p = jnp.exp(log_probs_fn(target, temperature, top_k, top_p))  # [B, K+1, V]
    q = jnp.exp(log_probs_fn(draft, temperature, top_k, top_p))  # [B, K, V]
    p_draft = p[:, :k]
    p_x = jnp.take_along_axis(p_draft, tokens, axis=-1)[..., 0]
    q_x = jnp.take_along_axis(q, tokens, axis=-1)[..., 0]
    accept = uniforms.astype(jnp.float32) * q_x < p_x  # P = min(1, p/q), no division
    if rule == "nsd":
        accept = accept | nucleus_member(p_draft, p_x, nsd_top_p)
    num = _leading_run(accept)

    residual = jnp.maximum(p_draft - q, 0.0)
    enough = jnp.sum(residual, axis=-1, keepdims=True) >= residual_floor
    # Row n of `weights` is what gets sampled when exactly n drafts are accepted.
    weights = jnp.concatenate([jnp.where(enough, residual, p_draft), p[:, k:]], axis=1)
    chosen = jnp.take_along_axis(weights, num[:, None, None], axis=1)[:, 0]
    return num, _race(chosen, exponentials.astype(jnp.float32)), accept


# ----------------------------------------------------------------------------- kernel


def _verify_kernel(settings_ref, tokens_ref, uniforms_ref, expo_ref, target_ref, draft_ref,
                   out_ref, *, k: int, block_v: int, n_tiles: int, rule: str):
    """One program: `bb` rows. out_ref [bb, 1, K+2] = (num_accepted, next_token, accept_0..K-1)."""
    bb = out_ref.shape[0]
    temperature = settings_ref[0]
    top_p = settings_ref[1]
    nsd_top_p = settings_ref[2]
    residual_floor = settings_ref[3]
    greedy_t = temperature <= 0.0
    t_eff = jnp.where(greedy_t, 1.0, temperature)
    zeros = jnp.zeros((bb,), jnp.float32)
    izeros = jnp.zeros((bb,), jnp.int32)
    neg_inf = jnp.full((bb,), -jnp.inf, jnp.float32)

    def tile_slice(j):
        return pl.ds(pl.multiple_of(j * block_v, block_v), block_v)

    def load(ref, i, j):  # [bb, block_v] float32 logits of position i, vocabulary tile j
        return ref[:, i, tile_slice(j)].astype(jnp.float32)

    def ids(j):
        return lax.broadcasted_iota(jnp.int32, (bb, block_v), 1) + j * block_v

    def over_tiles(body, init):
        return lax.fori_loop(0, n_tiles, body, init)

    def first_max(best, arg, values, j):
        """Running (max, first argmax) update with one tile; ties keep the earlier index."""
        tile_best = jnp.max(values, axis=1)
        tile_arg = jnp.min(jnp.where(values == tile_best[:, None], ids(j), _BIG_INDEX), axis=1)
        better = tile_best > best
        return jnp.where(better, tile_best, best), jnp.where(better, tile_arg, arg)

    def raw_argmax(ref, i):
        def body(j, carry):
            return first_max(*carry, load(ref, i, j), j)
        return over_tiles(body, (neg_inf, izeros))[1]

    def distribution(ref, i):
        """Returns tile j -> [bb, block_v] processed probabilities of position i, and argmax."""

        def normaliser(j, carry):
            m, l, raw_max, arg = carry
            x = load(ref, i, j)
            s = x / t_eff
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
            raw_max, arg = first_max(raw_max, arg, x, j)
            return m_new, l, raw_max, arg

        m, l, _, arg = over_tiles(normaliser, (neg_inf, zeros, neg_inf, izeros))

        def shifted(j):
            return load(ref, i, j) / t_eff - m[:, None]

        def full_probs(j):  # what top-p reads: the softmax before filtering
            return jnp.exp(shifted(j)) / l[:, None]

        def mass_above(t):
            def body(j, acc):
                pr = full_probs(j)
                return acc + jnp.sum(jnp.where(pr > t[:, None], pr, 0.0), axis=1)
            return over_tiles(body, zeros)

        def bisect():
            # Invariant: mass_above(hi) < top_p (hi starts at the max probability, 1/l), and
            # lo == -1 or mass_above(lo) >= top_p; stop once no float lies strictly between.
            # For top_p <= 0 hi stays at the max: the top token is always kept, as in the sort.
            def step(_, carry):
                lo, hi = carry
                mid = jnp.right_shift(lo + hi, 1)
                active = hi - lo > 1
                inside = mass_above(lax.bitcast_convert_type(mid, jnp.float32)) < top_p
                return (jnp.where(active & ~inside, mid, lo), jnp.where(active & inside, mid, hi))
            hi = lax.bitcast_convert_type(1.0 / l, jnp.int32)
            _, hi = lax.fori_loop(0, NUCLEUS_BISECTION_STEPS, step, (izeros - 1, hi))
            return lax.bitcast_convert_type(hi, jnp.float32)

        # Threshold 0 keeps everything: top_p >= 1 filters nothing (as processors.log_probs).
        threshold = lax.cond((top_p < 1.0) & ~greedy_t, bisect, lambda: zeros)

        def kept(j):
            return full_probs(j) >= threshold[:, None]

        def kept_sum(j, acc):
            return acc + jnp.sum(jnp.where(kept(j), jnp.exp(shifted(j)), 0.0), axis=1)

        log_kept = jnp.log(over_tiles(kept_sum, zeros))

        def probs(j):
            p = jnp.where(kept(j), jnp.exp(shifted(j) - log_kept[:, None]), 0.0)
            return jnp.where(greedy_t, (ids(j) == arg[:, None]).astype(jnp.float32), p)

        return probs, arg

    def race_update(best, arg, weights, j):
        e = expo_ref[:, 0, tile_slice(j)]
        return first_max(best, arg, jnp.where(weights > 0, weights / e, -1.0), j)

    def sample(probs):  # exponential race over one distribution
        def body(j, carry):
            return race_update(*carry, probs(j), j)
        return over_tiles(body, (neg_inf, izeros))[1]

    def position(i, carry):
        num, next_token, running = carry
        x = tokens_ref[:, 0, i]
        if rule == "greedy":
            candidate = raw_argmax(target_ref, i)
            accept = x == candidate
        else:
            p_probs, _ = distribution(target_ref, i)
            q_probs, _ = distribution(draft_ref, i)

            def at_token(j, c):
                p_x, q_x, p_max = c
                p, hit = p_probs(j), ids(j) == x[:, None]
                return (p_x + jnp.sum(jnp.where(hit, p, 0.0), axis=1),
                        q_x + jnp.sum(jnp.where(hit, q_probs(j), 0.0), axis=1),
                        jnp.maximum(p_max, jnp.max(p, axis=1)))

            p_x, q_x, p_max = over_tiles(at_token, (zeros, zeros, zeros))
            accept = uniforms_ref[:, 0, i] * q_x < p_x
            if rule == "nsd":
                def above(j, acc):
                    p = p_probs(j)
                    return acc + jnp.sum(jnp.where(p > p_x[:, None], p, 0.0), axis=1)
                mass = over_tiles(above, zeros)
                in_nucleus = jnp.where(nsd_top_p >= 1.0, p_x > 0.0,
                                       (mass < nsd_top_p) | (p_x >= p_max))
                accept = accept | in_nucleus

            def residual_race(j, c):
                mass, best_r, arg_r, best_p, arg_p = c
                p = p_probs(j)
                r = jnp.maximum(p - q_probs(j), 0.0)
                best_r, arg_r = race_update(best_r, arg_r, r, j)
                best_p, arg_p = race_update(best_p, arg_p, p, j)
                return mass + jnp.sum(r, axis=1), best_r, arg_r, best_p, arg_p

            mass, _, arg_r, _, arg_p = over_tiles(
                residual_race, (zeros, neg_inf, izeros, neg_inf, izeros))
            candidate = jnp.where(mass >= residual_floor, arg_r, arg_p)

        out_ref[:, 0, 2 + i] = accept.astype(jnp.int32)
        next_token = jnp.where(running & ~accept, candidate, next_token)
        running = running & accept
        return num + running.astype(jnp.int32), next_token, running

    num, next_token, running = lax.fori_loop(
        0, k, position, (izeros, izeros, jnp.ones((bb,), jnp.bool_)))
    if rule == "greedy":
        bonus = raw_argmax(target_ref, k)
    else:
        bonus = sample(distribution(target_ref, k)[0])
    out_ref[:, 0, 0] = num
    out_ref[:, 0, 1] = jnp.where(running, bonus, next_token)


def _backend_options(interpret: bool):
    """The one backend-specific place: (compiler_params, BlockSpec of the settings vector)."""
    plain = pl.BlockSpec((_NUM_SETTINGS,), lambda b: (0,))
    if interpret:
        return None, plain
    backend = jax.default_backend()
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return (pltpu.CompilerParams(dimension_semantics=("parallel",)),
                pl.BlockSpec(memory_space=pltpu.SMEM))
    if backend in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=4, num_stages=1), plain
    raise ValueError(f"no compiled Pallas verify kernel for backend {backend!r}: "
                     "use ref_verify, or interpret=True")


@functools.partial(jax.jit, static_argnames=("rule", "top_k", "block_sizes", "interpret"))
def verify(target_logits: jax.Array, draft_logits: jax.Array, draft_tokens: jax.Array,
           uniforms: jax.Array, exponentials: jax.Array, *, rule: str = "standard",
           temperature=1.0, top_k: int = 0, top_p=1.0, nsd_top_p=0.9, residual_floor=1e-8,
           block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """The Pallas kernel; same arguments and results as `ref_verify` (no top_k).

    Float settings may be traced (no recompilation); rule, top_k, block_sizes, interpret are
    static. Logits stay in their dtype in memory and are cast to float32 per tile.
    Returns (num_accepted [B] int32, next_token [B] int32, accept [B, K] bool).
    """
    b, k, v = validate_inputs(target_logits, draft_logits, draft_tokens, uniforms, exponentials,
                              rule=rule)
    if top_k:
        raise ValueError("the Pallas verify kernel does not support top_k > 0; use ref_verify")
    bb, bv = block_sizes.block_b, block_sizes.block_v
    b_pad, v_pad = pl.cdiv(b, bb) * bb, pl.cdiv(v, bv) * bv

    def pad_rows(x, value):
        return jnp.pad(x, [(0, b_pad - b)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    def pad_vocab(x, value):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, v_pad - v)], constant_values=value)

    # Padded vocabulary entries get -inf logits (probability 0); padded rows are finite dummies.
    target = pad_rows(pad_vocab(target_logits, -jnp.inf), 0.0)
    draft = pad_rows(pad_vocab(draft_logits, -jnp.inf), 0.0)
    tokens = pad_rows(draft_tokens.astype(jnp.int32), 0)[:, None, :]
    unif = pad_rows(uniforms.astype(jnp.float32), 0.5)[:, None, :]
    expo = pad_rows(pad_vocab(exponentials.astype(jnp.float32), 1.0), 1.0)[:, None, :]
    settings = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in
                          (temperature, top_p, nsd_top_p, residual_floor)])

    compiler_params, settings_spec = _backend_options(interpret)

    def rows(shape):
        return pl.BlockSpec((bb,) + shape, lambda i: (i, 0, 0))

    out = pl.pallas_call(
        functools.partial(_verify_kernel, k=k, block_v=bv, n_tiles=v_pad // bv, rule=rule),
        out_shape=jax.ShapeDtypeStruct((b_pad, 1, k + 2), jnp.int32),
        grid=(b_pad // bb,),
        in_specs=[settings_spec, rows((1, k)), rows((1, k)), rows((1, v_pad)),
                  rows((k + 1, v_pad)), rows((k, v_pad))],
        out_specs=rows((1, k + 2)),
        compiler_params=compiler_params,
        interpret=interpret,
        name="speculative_verify",
    )(settings, tokens, unif, expo, target, draft)
    out = out[:b, 0]
    return out[:, 0], out[:, 1], out[:, 2:].astype(jnp.bool_)
