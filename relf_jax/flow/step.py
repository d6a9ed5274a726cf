"""One Euler step of the ReLF flow, the step every sampler takes.

posterior_logits (`relf_jax.flow.singular`) -> softmax -> posterior_mean -> Euler update, in
float32, through `kernels_pallas.dispatch`: the fused Pallas kernel (singular logits + bounded
residual + online softmax + posterior mean + Euler update in one pass, the [B, L, V] posterior
never stored) where the dispatch policy runs it (GPU, TPU), the one plain-jnp reference
(`kernels_pallas.flow_step.ref_flow_step`) elsewhere or with ``RELF_JAX_FORCE_REFERENCE=1``.
Same results either way (tests compare them).
"""

from __future__ import annotations

import jax

from kernels_pallas import dispatch
from relf_jax.flow.singular import DEFAULT_T_EPS


def flow_step(z: jax.Array, t, t_next, residual_logits: jax.Array | None, embeddings: jax.Array, *,
              c: float | None, use_singular: bool = True, t_eps: float = DEFAULT_T_EPS,
              use_kernel: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """One Euler step of the flow: returns (Z_next [..., L, d], X1_hat [..., L, d]) float32.

    logits = posterior_logits(z, t, embeddings, residual_logits, c=c, use_singular=...);
    p = softmax(logits); X1_hat = p E; Z_next = Z + (t_next - t) (X1_hat - Z) / max(1 - t, t_eps).
    z [B, L, d]; t, t_next scalar, [B] or [B, L]; residual_logits [B, L, V] or None; embeddings
    [V, d]. use_kernel: True / False force the kernel / the reference; None: the dispatch policy
    (read at trace time).
    """
    return dispatch.flow_step(z, residual_logits, embeddings, t, t_next, c=c, use_singular=use_singular,
                              t_eps=t_eps, use_kernel=use_kernel)
