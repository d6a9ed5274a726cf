"""The ReLF posterior over tokens, its mean and the flow velocity (pure jnp, float32).

Path (t = 0 noise, t = 1 data), per position: Z_t = t E[w] + (1 - t) eps, eps ~ N(0, I).

Singular logits (our reading, methods.md section 1): given w, Z_t ~ N(t E[w], (1 - t)^2 I),
so log p(Z_t | w) up to a w-independent constant is

    s_w(Z_t, t) = ( t <Z_t, E[w]> - t^2 ||E[w]||^2 / 2 ) / (1 - t)^2.

softmax(s) is the exact posterior of a uniform prior over tokens; it sharpens to one-hot as
t -> 1, so the flow ends on an embedding row. The network adds a bounded residual
c tanh(f / c). Everything here is a free function so either term can be swapped or ablated.
One Euler step of the flow built from these is `relf_jax.flow.step.flow_step`.

Shapes: z [..., L, d] (usually [B, L, d]); t a scalar, [B] or [B, L] (broadcast over the
trailing axes); embeddings E [V, d]; logits and probabilities [..., L, V].
1 - t is clamped to >= t_eps wherever it divides. All matmuls run at HIGHEST precision: the
logits reach ~1/t_eps^2 near t = 1, and a bf16 pass (the TPU default for f32) would scramble them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_T_EPS = 1e-4
_HIGHEST = jax.lax.Precision.HIGHEST


def _time(t, ndim: int) -> jax.Array:
    """t as float32 with trailing singleton axes so it broadcasts against an `ndim` array."""
    t = jnp.asarray(t, jnp.float32)
    return t.reshape(t.shape + (1,) * (ndim - t.ndim))


def one_minus_t(t, t_eps: float = DEFAULT_T_EPS) -> jax.Array:
    """max(1 - t, t_eps) in float32 (same shape as t)."""
    return jnp.maximum(1.0 - jnp.asarray(t, jnp.float32), jnp.float32(t_eps))


def interpolate(x1: jax.Array, eps: jax.Array, t) -> jax.Array:
    """Z_t = t x1 + (1 - t) eps; x1, eps [..., L, d]; t scalar / [B] / [B, L]."""
    t = _time(t, jnp.ndim(x1))
    return t * x1 + (1.0 - t) * eps


def singular_logits(z: jax.Array, t, embeddings: jax.Array, t_eps: float = DEFAULT_T_EPS) -> jax.Array:
    """Gaussian-channel log-likelihoods s [..., L, V] of every token (formula in module doc)."""
    z = jnp.asarray(z, jnp.float32)
    e = jnp.asarray(embeddings, jnp.float32)
    t = _time(t, z.ndim)
    inner = jnp.einsum("...d,vd->...v", z, e, precision=_HIGHEST)
    sq_norm = jnp.sum(e * e, axis=-1)
    scale = one_minus_t(t, t_eps) ** 2
    return (t * inner - 0.5 * t * t * sq_norm) / scale


def bounded_residual(f: jax.Array, c: float | None) -> jax.Array:
    """c tanh(f / c) in float32 (|.| < c); c=None leaves f unbounded (ablation)."""
    f = jnp.asarray(f, jnp.float32)
    if c is None:
        return f
    if not c > 0:
        raise ValueError(f"residual bound c must be positive, got {c}")
    return c * jnp.tanh(f / c)


def posterior_logits(
    z: jax.Array,
    t,
    embeddings: jax.Array,
    residual_logits: jax.Array | None = None,
    *,
    c: float | None = None,
    use_singular: bool = True,
    t_eps: float = DEFAULT_T_EPS,
) -> jax.Array:
    """logits [..., L, V] = s(Z_t, t) + c tanh(f / c).

    Either term may be absent: residual_logits=None drops the residual; use_singular=False
    (the ablation) keeps only the residual (zeros when there is none -> uniform posterior).
    """
    if use_singular:
        logits = singular_logits(z, t, embeddings, t_eps)
    else:
        logits = jnp.zeros(jnp.shape(z)[:-1] + (jnp.shape(embeddings)[0],), jnp.float32)
    if residual_logits is not None:
        logits = logits + bounded_residual(residual_logits, c)
    return logits


def posterior_mean(probs: jax.Array, embeddings: jax.Array) -> jax.Array:
    """X1_hat [..., L, d] = sum_w p(w) E[w]; probs [..., L, V], embeddings [V, d]."""
    return jnp.einsum(
        "...v,vd->...d", jnp.asarray(probs, jnp.float32), jnp.asarray(embeddings, jnp.float32),
        precision=_HIGHEST,
    )


def velocity(z: jax.Array, t, x1_hat: jax.Array, t_eps: float = DEFAULT_T_EPS) -> jax.Array:
    """v [..., L, d] = (X1_hat - Z_t) / max(1 - t, t_eps)."""
    z = jnp.asarray(z, jnp.float32)
    return (jnp.asarray(x1_hat, jnp.float32) - z) / one_minus_t(_time(t, z.ndim), t_eps)


def straightness(
    z0: jax.Array,
    z1: jax.Array,
    v_fn: Callable[[jax.Array, jax.Array], jax.Array],
    ts: jax.Array,
) -> jax.Array:
    """Mean over times, batch and positions of || (Z_1 - Z_0) - v(Z_t, t) ||^2 (scalar f32).

    z0, z1 [B, L, d] are the endpoints of one coupling (noise, data); Z_t = t z1 + (1 - t) z0;
    v_fn(z [B, L, d], t [B]) -> velocity [B, L, d]; ts [T] the times to average over.
    Zero iff the model's velocity is the straight line on those times.
    """
    z0 = jnp.asarray(z0, jnp.float32)
    z1 = jnp.asarray(z1, jnp.float32)
    target = z1 - z0

    def one_time(t):
        tb = jnp.full((z0.shape[0],), t, jnp.float32)
        err = target - v_fn(interpolate(z1, z0, tb), tb)
        return jnp.mean(jnp.sum(err * err, axis=-1))

    return jnp.mean(jax.lax.map(one_time, jnp.asarray(ts, jnp.float32)))


EVIDENCE_CLIP = 10.0  # the evidence input's log-posterior floor (and its scale)


def evidence_input(z: jax.Array, t, embeddings: jax.Array) -> jax.Array:
    """The ``evidence`` input of a ReLF network built with ``flow_evidence_input`` [..., L, V]:
    each position's singular log-posterior, clipped below at -EVIDENCE_CLIP and divided by it."""
    return jnp.maximum(jax.nn.log_softmax(singular_logits(z, t, embeddings), axis=-1), -EVIDENCE_CLIP) / EVIDENCE_CLIP


def network_residual(model, z, sc, t, known=None, segment_ids=None, embeddings=None, *, aux: bool = False):
    """The ReLF network's residual logits ``model(z, sc, t, known, segment_ids)``, with the
    evidence input computed from `embeddings` when the network reads it (`FlowLM.reads_evidence`);
    ``aux=True``: (residual, auxiliary head's logits), `FlowLM.logits_and_aux`."""
    evidence = None
    if getattr(model, "reads_evidence", False):
        if embeddings is None:
            raise ValueError("this ReLF model reads each position's evidence (model.flow_evidence_input): "
                             "pass the fixed embeddings")
        evidence = evidence_input(z, t, embeddings)
    call = model.logits_and_aux if aux else model
    # the embeddings also feed the default's embedding-tied head (`FlowLM`, ``flow_embed_head``)
    return call(z, sc, t, known, segment_ids, evidence=evidence, embeddings=embeddings)
