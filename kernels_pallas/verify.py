"""Speculative-decoding verification as one Pallas kernel, with its plain-jnp reference.

For every batch row the kernel transforms the target's K+1 and the draft's K logit rows
(temperature, then top-p), decides each draft token under the standard, NSD or greedy rule,
cuts at the first rejection and emits one token: a sample of the residual norm(max(0, p - q))
at the first rejection (p itself when the residual mass is below `residual_floor`), or the
bonus token from the target's last row when all K drafts are accepted.

Randomness is an input, never drawn here: uniforms [B, K] for the acceptance tests and
Exp(1) noise [B, V] for the one sample per row (exponential race: the token is
argmax_v w_v / E_v over w_v > 0, which is distributed as norm(w)). The kernel and `ref_verify`
therefore make identical decisions for identical noise. The reference and the decisions it
shares with the sparse (n-gram candidate) path live in `kernels_pallas.verify_ref`.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas.verify_ref import (  # noqa: F401  (the reference, re-exported beside its kernel)
    RULES,
    first_argmax,
    nucleus_member,
    ref_log_probs,
    ref_nucleus_mask,
    ref_verify,
    ref_verify_sparse,
    validate_inputs,
)

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


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """One program's view of the vocabulary: `bb` rows, `n_tiles` tiles of `block_v` entries."""

    bb: int
    block_v: int
    n_tiles: int

    def slice(self, j):
        return pl.ds(pl.multiple_of(j * self.block_v, self.block_v), self.block_v)

    def load(self, ref, i, j):  # [bb, block_v] float32 logits of position i, vocabulary tile j
        return ref[:, i, self.slice(j)].astype(jnp.float32)

    def ids(self, j):
        return lax.broadcasted_iota(jnp.int32, (self.bb, self.block_v), 1) + j * self.block_v

    def over(self, body, init):
        return lax.fori_loop(0, self.n_tiles, body, init)

    def zeros(self):
        return jnp.zeros((self.bb,), jnp.float32)

    def izeros(self):
        return jnp.zeros((self.bb,), jnp.int32)

    def neg_inf(self):
        return jnp.full((self.bb,), -jnp.inf, jnp.float32)

    def first_max(self, best, arg, values, j):
        """Running (max, first argmax) update with one tile; ties keep the earlier index."""
        tile_best = jnp.max(values, axis=1)
        tile_arg = jnp.min(jnp.where(values == tile_best[:, None], self.ids(j), _BIG_INDEX), axis=1)
        better = tile_best > best
        return jnp.where(better, tile_best, best), jnp.where(better, tile_arg, arg)


def _raw_argmax(tiles: _Tiles, ref, i):
    def body(j, carry):
        return tiles.first_max(*carry, tiles.load(ref, i, j), j)
    return tiles.over(body, (tiles.neg_inf(), tiles.izeros()))[1]


def _nucleus_threshold(tiles: _Tiles, full_probs, l, top_p):
    """t0, the smallest probability whose mass_above is < top_p, by bisection on float32 bits.

    Invariant: mass_above(hi) < top_p (hi starts at the max probability, 1/l), and lo == -1 or
    mass_above(lo) >= top_p; stop once no float lies strictly between. For top_p <= 0 hi stays
    at the max: the top token is always kept, as in the sort."""
    def mass_above(t):
        def body(j, acc):
            pr = full_probs(j)
            return acc + jnp.sum(jnp.where(pr > t[:, None], pr, 0.0), axis=1)
        return tiles.over(body, tiles.zeros())

    def step(_, carry):
        lo, hi = carry
        mid = jnp.right_shift(lo + hi, 1)
        active = hi - lo > 1
        inside = mass_above(lax.bitcast_convert_type(mid, jnp.float32)) < top_p
        return (jnp.where(active & ~inside, mid, lo), jnp.where(active & inside, mid, hi))

    hi = lax.bitcast_convert_type(1.0 / l, jnp.int32)
    _, hi = lax.fori_loop(0, NUCLEUS_BISECTION_STEPS, step, (tiles.izeros() - 1, hi))
    return lax.bitcast_convert_type(hi, jnp.float32)


def _distribution(tiles: _Tiles, ref, i, temperature, top_p):
    """Returns tile j -> [bb, block_v] processed probabilities of position i, and its argmax."""
    greedy_t = temperature <= 0.0
    t_eff = jnp.where(greedy_t, 1.0, temperature)

    def normaliser(j, carry):
        m, l, raw_max, arg = carry
        x = tiles.load(ref, i, j)
        s = x / t_eff
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(s - m_new[:, None]), axis=1)
        raw_max, arg = tiles.first_max(raw_max, arg, x, j)
        return m_new, l, raw_max, arg

    m, l, _, arg = tiles.over(normaliser, (tiles.neg_inf(), tiles.zeros(), tiles.neg_inf(), tiles.izeros()))

    def shifted(j):
        return tiles.load(ref, i, j) / t_eff - m[:, None]

    def full_probs(j):  # what top-p reads: the softmax before filtering
        return jnp.exp(shifted(j)) / l[:, None]

    # Threshold 0 keeps everything: top_p >= 1 filters nothing (as processors.log_probs).
    threshold = lax.cond((top_p < 1.0) & ~greedy_t, lambda: _nucleus_threshold(tiles, full_probs, l, top_p),
                         tiles.zeros)

    def kept(j):
        return full_probs(j) >= threshold[:, None]

    def kept_sum(j, acc):
        return acc + jnp.sum(jnp.where(kept(j), jnp.exp(shifted(j)), 0.0), axis=1)

    log_kept = jnp.log(tiles.over(kept_sum, tiles.zeros()))

    def probs(j):
        p = jnp.where(kept(j), jnp.exp(shifted(j) - log_kept[:, None]), 0.0)
        return jnp.where(greedy_t, (tiles.ids(j) == arg[:, None]).astype(jnp.float32), p)

    return probs, arg


def _race_update(tiles: _Tiles, expo_ref, best, arg, weights, j):
    e = expo_ref[:, 0, tiles.slice(j)]
    return tiles.first_max(best, arg, jnp.where(weights > 0, weights / e, -1.0), j)


def _sample(tiles: _Tiles, expo_ref, probs):
    """Exponential race over one distribution (tile function `probs`)."""
    def body(j, carry):
        return _race_update(tiles, expo_ref, *carry, probs(j), j)
    return tiles.over(body, (tiles.neg_inf(), tiles.izeros()))[1]


def _sampled_decision(tiles: _Tiles, refs, i, x, uniform, settings, rule: str):
    """Standard / NSD rule at position i: (accept [bb] bool, the residual sample [bb])."""
    target_ref, draft_ref, expo_ref = refs
    temperature, top_p, nsd_top_p, residual_floor = settings
    p_probs, _ = _distribution(tiles, target_ref, i, temperature, top_p)
    q_probs, _ = _distribution(tiles, draft_ref, i, temperature, top_p)
    zeros = tiles.zeros()

    def at_token(j, c):
        p_x, q_x, p_max = c
        p, hit = p_probs(j), tiles.ids(j) == x[:, None]
        return (p_x + jnp.sum(jnp.where(hit, p, 0.0), axis=1),
                q_x + jnp.sum(jnp.where(hit, q_probs(j), 0.0), axis=1),
                jnp.maximum(p_max, jnp.max(p, axis=1)))

    p_x, q_x, p_max = tiles.over(at_token, (zeros, zeros, zeros))
    accept = uniform * q_x < p_x
    if rule == "nsd":
        def above(j, acc):
            p = p_probs(j)
            return acc + jnp.sum(jnp.where(p > p_x[:, None], p, 0.0), axis=1)
        mass = tiles.over(above, zeros)
        in_nucleus = jnp.where(nsd_top_p >= 1.0, p_x > 0.0, (mass < nsd_top_p) | (p_x >= p_max))
        accept = accept | in_nucleus

    def residual_race(j, c):
        mass, best_r, arg_r, best_p, arg_p = c
        p = p_probs(j)
        r = jnp.maximum(p - q_probs(j), 0.0)
        best_r, arg_r = _race_update(tiles, expo_ref, best_r, arg_r, r, j)
        best_p, arg_p = _race_update(tiles, expo_ref, best_p, arg_p, p, j)
        return mass + jnp.sum(r, axis=1), best_r, arg_r, best_p, arg_p

    mass, _, arg_r, _, arg_p = tiles.over(
        residual_race, (zeros, tiles.neg_inf(), tiles.izeros(), tiles.neg_inf(), tiles.izeros()))
    return accept, jnp.where(mass >= residual_floor, arg_r, arg_p)


def _verify_kernel(settings_ref, tokens_ref, uniforms_ref, expo_ref, target_ref, draft_ref,
                   out_ref, *, k: int, block_v: int, n_tiles: int, rule: str):
    """One program: `bb` rows. out_ref [bb, 1, K+2] = (num_accepted, next_token, accept_0..K-1)."""
    bb = out_ref.shape[0]
    tiles = _Tiles(bb, block_v, n_tiles)
    settings = tuple(settings_ref[s] for s in range(_NUM_SETTINGS))  # temperature, top_p, nsd_top_p, floor
    refs = (target_ref, draft_ref, expo_ref)

    def position(i, carry):
        num, next_token, running = carry
        x = tokens_ref[:, 0, i]
        if rule == "greedy":
            candidate = _raw_argmax(tiles, target_ref, i)
            accept = x == candidate
        else:
            accept, candidate = _sampled_decision(tiles, refs, i, x, uniforms_ref[:, 0, i], settings, rule)
        out_ref[:, 0, 2 + i] = accept.astype(jnp.int32)
        next_token = jnp.where(running & ~accept, candidate, next_token)
        running = running & accept
        return num + running.astype(jnp.int32), next_token, running

    num, next_token, running = lax.fori_loop(
        0, k, position, (tiles.izeros(), tiles.izeros(), jnp.ones((bb,), jnp.bool_)))
    if rule == "greedy":
        bonus = _raw_argmax(tiles, target_ref, k)
    else:
        bonus = _sample(tiles, expo_ref, _distribution(tiles, target_ref, k, settings[0], settings[1])[0])
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
