"""Verification rules of speculative decoding: standard (exact), NSD (nucleus) and greedy.

A draft proposed K tokens x_1..x_K with distributions q_i; the target scored K+1 positions
(p_0..p_K). Both go through the same `processors.log_probs` transform (temperature -> top-k ->
top-p) in float32. Per position i:

- standard: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), tested as
  u_i * q_i(x_i) < p_i(x_i) with u_i ~ U[0, 1) (no division). Exact: the output is p.
- nsd: accept if the standard test accepts OR x_i is in the target nucleus
  N = nucleus_mask(p_i, nsd_top_p). On rejection the same residual as the standard rule
  (our reading of the paper). One-step deviation: TV(out, p) = sum_{x in N} max(0, q - p).
- greedy: accept iff x_i == argmax of the raw target logits at i.

num_accepted n is the length of the leading run of accepts. At the first rejection n < K the
emitted token is a sample of the residual norm(max(0, p_n - q_n)) (p_n itself when the
residual mass is below `residual_floor`); greedy emits argmax p_n. When all K are accepted the
bonus token is a sample of p_K (greedy: its argmax). Samples use an exponential race
(argmax_v w_v / E_v, E ~ Exp(1)). At temperature 0, p and q are one-hot and the standard and
NSD rules reduce to greedy speculative decoding.

The decision logic is written once, in `kernels_pallas.verify_ref` (`ref_verify`, plain jnp,
and its sparse-candidate twin, sharing the decisions) and the Pallas kernel that reproduces it;
this module draws the noise and calls them through `kernels_pallas.dispatch` (which picks the
path).
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import dispatch
from relf_jax.sampling import processors

RULES = dispatch.RULES


@flax.struct.dataclass
class VerifyResult:
    """Outcome of verifying one round of K draft tokens for B rows.

    num_accepted: [B] int32 in 0..K, length of the accepted draft prefix.
    next_token: [B] int32, the residual sample at the first rejection, or the bonus token
      from p_K when all K were accepted.
    accept: [B, K] bool, every position's decision before the prefix cut (statistics,
      RCSD traces).
    """

    num_accepted: jax.Array
    next_token: jax.Array
    accept: jax.Array


def verify(target_logits: jax.Array, draft_logits: jax.Array, draft_tokens: jax.Array,
           key: jax.Array, *, rule: str = "standard", temperature=1.0, top_k: int = 0,
           top_p=1.0, nsd_top_p=0.9, residual_floor=1e-8,
           use_kernel: bool | None = None) -> VerifyResult:
    """Verifies K draft tokens per row against the target.

    Args:
      target_logits: [B, K+1, V] raw target logits (any float dtype; decisions in float32).
      draft_logits: [B, K, V] raw draft logits at the K drafted positions.
      draft_tokens: [B, K] int token ids drafted from the (transformed) draft distributions.
      key: PRNG key; uniforms [B, K] and Exp(1) noise [B, V] are drawn from it.
      rule: "standard" | "nsd" | "greedy" (static).
      temperature, top_p, nsd_top_p, residual_floor: floats, may be traced.
      top_k: static int; 0 disables. The kernel has no top-k: with top_k > 0, use_kernel=None
        takes the reference path and use_kernel=True raises ValueError.
        top_p None or a Python number >= 1 leaves the nucleus filter out at trace time (no
        sort is compiled; `processors.log_probs`).
      use_kernel: True -> Pallas kernel (interpreted on CPU), False -> reference, None ->
        the policy of `kernels_pallas.dispatch` (reference on CPU and GPU or with
        RELF_JAX_FORCE_REFERENCE=1, kernel on TPU).
        Read at trace time.
    Returns:
      VerifyResult(num_accepted [B], next_token [B], accept [B, K]).
    """
    if top_p is not None and processors.static_off(top_p, lambda x: x >= 1.0):
        top_p = None
    return _verify(target_logits, draft_logits, draft_tokens, key, rule=rule, temperature=temperature,
                   top_k=top_k, top_p=top_p, nsd_top_p=nsd_top_p, residual_floor=residual_floor,
                   use_kernel=use_kernel)


def _noise(key: jax.Array, b: int, k: int, v: int) -> tuple[jax.Array, jax.Array]:
    """The round's noise: uniforms [B, K] for the acceptance tests, Exp(1) [B, V] for the race."""
    key_accept, key_race = jax.random.split(key)
    return (jax.random.uniform(key_accept, (b, k), jnp.float32),
            jax.random.exponential(key_race, (b, v), jnp.float32))


@functools.partial(jax.jit, static_argnames=("rule", "top_k", "use_kernel"))
def _verify(target_logits, draft_logits, draft_tokens, key, *, rule, temperature, top_k, top_p, nsd_top_p,
            residual_floor, use_kernel) -> VerifyResult:
    b, k, v = dispatch.validate_verify_inputs(target_logits, draft_logits, draft_tokens, rule=rule)
    num, next_token, accept = dispatch.verify(
        target_logits, draft_logits, draft_tokens, *_noise(key, b, k, v), rule=rule, temperature=temperature,
        top_k=top_k, top_p=top_p, nsd_top_p=nsd_top_p, residual_floor=residual_floor,
        log_probs_fn=processors.log_probs, use_kernel=use_kernel)
    return VerifyResult(num_accepted=num, next_token=next_token, accept=accept)


def verify_sparse(target_logits: jax.Array, cand_ids: jax.Array, cand_logits: jax.Array,
                  draft_tokens: jax.Array, key: jax.Array, *, rule: str = "standard", temperature=1.0,
                  top_k: int = 0, top_p=1.0, nsd_top_p=0.9, residual_floor=1e-8) -> VerifyResult:
    """`verify` for a draft whose distribution at each position lives on M candidates (the
    corpus n-gram table's, `relf_jax.speculative.ngram_draft.next_candidates`).

    cand_ids [B, K, M] token ids and cand_logits [B, K, M] raw logits (-inf on padding; a padded
    entry may repeat a candidate's id): the draft logits are what
    `ngram_draft.candidate_logits` would scatter over the vocabulary, and the rule, noise and
    decisions are `verify`'s on those (reference path), up to float rounding. It costs less:
    the draft's transform runs over M entries instead of V, and the residual
    norm(max(0, p - q)) is built at the emitted position only, p with its candidates lowered.
    Other arguments as in `verify`.
    """
    if top_p is not None and processors.static_off(top_p, lambda x: x >= 1.0):
        top_p = None
    return _verify_sparse(target_logits, cand_ids, cand_logits, draft_tokens, key, rule=rule,
                          temperature=temperature, top_k=top_k, top_p=top_p, nsd_top_p=nsd_top_p,
                          residual_floor=residual_floor)


@functools.partial(jax.jit, static_argnames=("rule", "top_k"))
def _verify_sparse(target_logits, cand_ids, cand_logits, draft_tokens, key, *, rule, temperature, top_k, top_p,
                   nsd_top_p, residual_floor) -> VerifyResult:
    b, _, v = target_logits.shape
    num, next_token, accept = dispatch.verify_sparse(
        target_logits, cand_ids, cand_logits, draft_tokens, *_noise(key, b, draft_tokens.shape[1], v), rule=rule,
        temperature=temperature, top_k=top_k, top_p=top_p, nsd_top_p=nsd_top_p, residual_floor=residual_floor,
        log_probs_fn=processors.log_probs)  # the same noise as `_verify`
    return VerifyResult(num_accepted=num, next_token=next_token, accept=accept)


def output_distribution(p, q, rule: str, nsd_top_p: float = 0.9,
                        residual_floor: float = 1e-8) -> np.ndarray:
    """Exact distribution [V] (float64) of the token emitted at one verified position.

    p, q: [V] target and draft distributions after the shared transform. With acceptance
    probability a(y) of a drafted y ~ q and residual r:
    out(y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y).
    standard: a = min(1, p/q), r = norm(max(0, p - q)) (p when its mass < residual_floor);
    nsd: a = 1 on nucleus_mask(p, nsd_top_p), else as standard; greedy: one-hot argmax p.
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    if rule == "greedy":
        return np.eye(p.shape[-1])[np.argmax(p)]
    accept = np.minimum(1.0, np.divide(p, q, out=np.ones_like(p), where=q > 0))
    if rule == "nsd":
        in_nucleus = np.asarray(processors.nucleus_mask(jnp.asarray(p, jnp.float32), nsd_top_p))
        accept = np.where(in_nucleus, 1.0, accept)
    residual = np.maximum(p - q, 0.0)
    mass = residual.sum()
    residual = residual / mass if mass >= residual_floor else p
    accepted = q * accept
    return accepted + (1.0 - accepted.sum()) * residual
