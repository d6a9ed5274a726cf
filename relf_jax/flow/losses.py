"""ReLF training losses for the generic train loop.

``make_flow_loss(settings)`` returns ``loss_fn(model, batch, key, frozen)`` where `frozen`
holds the fixed token embeddings (``{"embeddings": [V, d]}``), passed to the compiled step as
an argument. For each row of token ids x (the first L tokens of a packed row):

    t ~ p(t)  (uniform or logit-normal),  eps ~ N(0, I),  Z_t = t E[x] + (1 - t) eps,
    sc = stop_gradient(X1_hat of a first pass with sc = 0) with probability p_sc, else 0,
    logits = singular_logits(Z_t, t) + c tanh(f(Z_t, sc, t) / c),

and the loss is the cross-entropy of x under softmax(logits) (methods.md: CE beat MSE), or, for
the ablation, the squared error of the predicted velocity against E[x] - eps.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from relf_jax.flow.singular import interpolate, posterior_logits, posterior_mean, velocity


@dataclasses.dataclass(frozen=True)
class FlowLossSettings:
    residual_bound: float = 10.0
    use_singular: bool = True
    t_eps: float = 1e-4
    t_distribution: str = "uniform"  # uniform | logit_normal
    self_condition_prob: float = 0.5
    loss: str = "ce"  # ce | mse


def sample_times(key: jax.Array, batch: int, distribution: str) -> jax.Array:
    """t in (0, 1) per row: uniform, or logit-normal (sigmoid of a standard normal)."""
    if distribution == "uniform":
        return jax.random.uniform(key, (batch,), jnp.float32)
    if distribution == "logit_normal":
        return jax.nn.sigmoid(jax.random.normal(key, (batch,), jnp.float32))
    raise ValueError(f"unknown t distribution {distribution!r}")


def flow_inputs(batch: dict) -> tuple[jax.Array, jax.Array]:
    """(token ids [B, L], mask [B, L]) of a packed batch: its first L = seq_len tokens."""
    tokens = batch["tokens"][:, :-1]
    mask = (batch["segment_ids"][:, :-1] != 0).astype(jnp.float32)
    return tokens, mask


def make_flow_loss(settings: FlowLossSettings):
    s = settings

    def loss_fn(model, batch, key, frozen):
        embeddings = frozen["embeddings"].astype(jnp.float32)
        tokens, mask = flow_inputs(batch)
        b = tokens.shape[0]
        k_t, k_eps, k_sc = jax.random.split(key, 3)
        t = sample_times(k_t, b, s.t_distribution)
        x1 = jnp.take(embeddings, tokens, axis=0)
        eps = jax.random.normal(k_eps, x1.shape, jnp.float32)
        z = interpolate(x1, eps, t)

        def logits_of(sc):
            f = model(z, sc, t)
            return posterior_logits(z, t, embeddings, f, c=s.residual_bound, use_singular=s.use_singular,
                                    t_eps=s.t_eps)

        zeros = jnp.zeros_like(z)
        first = jax.lax.stop_gradient(logits_of(zeros))
        sc_guess = posterior_mean(jax.nn.softmax(first, axis=-1), embeddings)
        use_sc = jax.random.bernoulli(k_sc, s.self_condition_prob, (b, 1, 1))
        logits = logits_of(jnp.where(use_sc, sc_guess, zeros))
        logp = jax.nn.log_softmax(logits, axis=-1)
        n = jnp.maximum(mask.sum(), 1.0)
        ce = -(jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0] * mask).sum() / n
        accuracy = ((jnp.argmax(logits, -1) == tokens) * mask).sum() / n
        if s.loss == "ce":
            loss = ce
        elif s.loss == "mse":
            v = velocity(z, t, posterior_mean(jnp.exp(logp), embeddings), s.t_eps)
            loss = (((v - (x1 - eps)) ** 2).mean(-1) * mask).sum() / n
        else:
            raise ValueError(f"unknown flow loss {s.loss!r}")
        return loss, {"tokens": mask.sum(), "ce": ce, "accuracy": accuracy}

    return loss_fn
