"""The exact posterior of the Gaussian path when the data is a finite set of rows: the denoiser a
trained ReLF network approximates, known in closed form for toy data (`relf-jax bench relf-toy`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.flow.singular import singular_logits


def exact_residual(rows: np.ndarray, table: jax.Array):
    """residual_fn(z, t, sc) whose posterior (with the singular logits, no bound) is the exact one
    for data drawn uniformly from `rows` [M, L + 1] (the first L tokens are the sequence) under the
    embedding `table` [V, d]: a softmax over the rows of the path likelihood N(z; t e(x), (1-t)^2)."""
    cand = jnp.asarray(rows[:, :-1])
    e = table[cand]  # [M, L, d]
    onehot = jax.nn.one_hot(cand, table.shape[0], dtype=jnp.float32)  # [M, L, V]

    def residual(z, t, sc, *unused):
        tt = t[:, None, None, None]
        ll = -((z[:, None] - tt * e[None]) ** 2).sum((-1, -2)) / (2.0 * (1.0 - t[:, None]) ** 2)
        p = jnp.einsum("bm,mlv->blv", jax.nn.softmax(ll, -1), onehot)
        return jnp.log(jnp.maximum(p, 1e-30)) - singular_logits(z, t, table)
    return residual
