"""ReLF training losses for the generic train loop.

``make_flow_loss(settings)`` returns ``loss_fn(model, batch, key, frozen)`` where `frozen`
holds the fixed token embeddings (``{"embeddings": [V, d]}``), passed to the compiled step as
an argument. For each row of token ids x (the first L tokens of a packed row):

    t ~ p(t)  (uniform, logit-normal or late),  eps ~ N(0, I),  Z_t = t E[x] + (1 - t) eps,
    sc = stop_gradient(X1_hat of a first pass with sc = 0) with probability p_sc, else 0,
    logits = singular_logits(Z_t, t) + c tanh(f(Z_t, sc, t) / c),

and the loss is the cross-entropy of x under softmax(logits) (methods.md: CE beat MSE), or, for
the ablation, the squared error of the predicted velocity against E[x] - eps, at the positions
with a non-zero segment id; the network attends within segments (`flow_inputs`).

Times per position (``per_position_t`` > 0, our extension): in that share of rows every position
draws its own t (Z_t, the singular logits and the network's conditioning then use t [B, L]); the
other rows share one t as in the paper, and so does sampling. Why (our reading of
`relf-jax bench relf-toy`, where the paper's loss leaves the network at the positional prior):
with one t per row, the rows where a position's own evidence is weak, and so where the loss
still has something to teach, are exactly the rows where its neighbours' evidence is weak too.
With independent times many positions are noisy among cleaner neighbours, and reading them pays
more.

A clean start (a batch field ``t_min`` [B] float32, added by `relf_jax.flow.recipes.CleanStart`
for the first ``flow.clean_start`` share of the steps): rows with ``t_min`` > 0 draw t uniformly
from [t_min, 1) instead. Why (our reading of `relf_core.topic_knowledge`): the conversation's topic
is readable from the neighbours only near t = 1, and a network trained over the whole t range from
the start never learns to read it (nor does one with half its rows near 1); learned first on
near-clean rows, the reading survives the full range and sharpens.

Auxiliary head (``aux_weight`` > 0, our extension; the model needs ``flow_aux_head``): the loss
adds aux_weight x the cross-entropy of x under softmax(f_aux), a second head on the same trunk
with no singular logits, on the same positions. Why: with the singular logits supplying each
position's own evidence, the paper's loss alone leaves the trunk at the positional prior
(`relf-jax bench relf-toy`); a singular-free classifier makes it learn what each noisy token is,
which the residual can then read from the neighbours. Sampling never uses the auxiliary head.

Context loss (``context_loss``, with a blind-spot model: ``flow.blind_spot``, the default since
issue 35; `FlowLossSettings` itself defaults to the paper's loss): the
cross-entropy is taken under softmax(c tanh(f / c)) alone, so the network learns the classifier
p(x_i | Z_{-i}); sampling adds the singular logits as usual, and their sum is the exact log
posterior when the classifier is exact (Z_i depends on x_i and its own noise only). Why: trained
under the sum, the network gets no gradient wherever s already decides the token (high t), and
that is where reading clean neighbours is learned (`relf-jax bench relf-toy`, variant
``blind_spot``). The self-conditioning guess keeps the singular logits (the sampler's X1_hat).

Prompt training (``prompt_prob`` > 0, our extension; the model needs ``flow_prompt_input``): in
that share of rows a prefix of k tokens, k uniform in 1 .. n - 1 for a row of n text (non-pad) tokens, is
given clean (Z = E[x], sc = E[x] when self-conditioning) and flagged `known`; the loss covers the
other positions only. The network then learns p(rest | prompt) itself, which is what prompted
sampling (`samplers`, ``prompt="clean"``) asks of it. The other rows train exactly as above.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from relf_jax.flow.singular import interpolate, network_residual, posterior_logits, posterior_mean, velocity


@dataclasses.dataclass(frozen=True)
class FlowLossSettings:
    residual_bound: float = 10.0
    use_singular: bool = True
    t_eps: float = 1e-4
    t_distribution: str = "uniform"  # uniform | logit_normal | late
    self_condition_prob: float = 0.5
    loss: str = "ce"  # ce | mse
    prompt_prob: float = 0.0  # share of rows trained with a clean, flagged prompt prefix
    pad_id: int = -1  # the prefix is drawn within a row's text: its positions that are not pad
    aux_weight: float = 0.0  # weight of the auxiliary singular-free head's CE (model.flow_aux_head)
    per_position_t: float = 0.0  # share of rows whose positions draw independent times
    # train the residual alone as the context classifier p(x_i | Z_{-i}) (a blind-spot model);
    # sampling still adds the singular logits
    context_loss: bool = False


_BELOW_ONE = float(np.nextafter(np.float32(1.0), np.float32(0.0)))


def prompt_prefix(key: jax.Array, mask: jax.Array, prob: float) -> jax.Array:
    """known [B, L] bool: in a `prob` share of rows, the first k positions, k uniform in
    1 .. n - 1 where n = the row's count of unmasked positions (rows with n < 2 get none)."""
    k_row, k_len = jax.random.split(key)
    n = mask.sum(-1).astype(jnp.int32)
    u = jax.random.uniform(k_len, n.shape)
    k = 1 + jnp.floor(u * jnp.maximum(n - 1, 0)).astype(jnp.int32)  # 1 .. n - 1
    chosen = jax.random.bernoulli(k_row, prob, n.shape) & (n >= 2)
    return (jnp.arange(mask.shape[1])[None, :] < k[:, None]) & chosen[:, None]


def sample_times(key: jax.Array, batch: int | tuple[int, ...], distribution: str) -> jax.Array:
    """t in (0, 1) of shape `batch` (an int: one per row): uniform, logit-normal (sigmoid of a
    standard normal), or late: t = 1 - (1 - u)^2 for uniform u, density 1 / (2 sqrt(1 - t)), the
    spacing of the samplers' "late" grid (half the draws above t = 0.75, where the posterior
    decides)."""
    shape = (batch,) if isinstance(batch, int) else tuple(batch)
    if distribution == "uniform":
        return jax.random.uniform(key, shape, jnp.float32)
    if distribution == "logit_normal":
        return jax.nn.sigmoid(jax.random.normal(key, shape, jnp.float32))
    if distribution == "late":
        t = 1.0 - jnp.square(1.0 - jax.random.uniform(key, shape, jnp.float32))
        return jnp.minimum(t, _BELOW_ONE)  # < 1, as the uniform's
    raise ValueError(f"unknown t distribution {distribution!r}")


def training_times(key: jax.Array, key_positions: jax.Array, s: FlowLossSettings, shape: tuple[int, int],
                   t_min: jax.Array | None = None) -> jax.Array:
    """The training times of a batch of `shape` [B, L]: [B] (one per row, from ``s.t_distribution``),
    or [B, L] with ``s.per_position_t`` > 0 (in that share of rows each position draws its own,
    from `key_positions`). Rows whose ``t_min`` [B] is > 0 (a clean start) draw from [t_min, 1)."""
    b = shape[0]
    t = sample_times(key, b, s.t_distribution)
    if s.per_position_t > 0:
        k_pos, k_rows = jax.random.split(key_positions)
        own = jax.random.bernoulli(k_rows, s.per_position_t, (b, 1))
        t = jnp.where(own, sample_times(k_pos, shape, s.t_distribution), t[:, None])  # [B, L]
    if t_min is not None:
        t_min = jnp.asarray(t_min, jnp.float32)
        t_min = t_min[:, None] if t.ndim == 2 else t_min
        near = t_min + (1.0 - t_min) * jax.random.uniform(jax.random.fold_in(key, 1), t.shape, jnp.float32)
        t = jnp.where(t_min > 0, jnp.minimum(near, _BELOW_ONE), t)
    return t


def flow_inputs(batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(token ids [B, L], mask [B, L] float32, segment ids [B, L] int32) of a batch: its first
    L = seq_len positions. The loss covers positions with a non-zero segment id: with
    ``data.rows="segments"`` (several whole documents per row) that is exactly the text, and the
    network attends within segments (`relf_jax.data.pipeline`)."""
    segments = batch["segment_ids"][:, :-1].astype(jnp.int32)
    return batch["tokens"][:, :-1], (segments != 0).astype(jnp.float32), segments


def make_flow_loss(settings: FlowLossSettings):
    s = settings

    def loss_fn(model, batch, key, frozen):
        embeddings = frozen["embeddings"].astype(jnp.float32)
        tokens, mask, segments = flow_inputs(batch)
        b = tokens.shape[0]
        k_t, k_eps, k_sc, k_prompt = jax.random.split(key, 4)
        t = training_times(k_t, jax.random.fold_in(key, 1), s, tokens.shape, batch.get("t_min"))
        x1 = jnp.take(embeddings, tokens, axis=0)
        eps = jax.random.normal(k_eps, x1.shape, jnp.float32)
        z = interpolate(x1, eps, t)
        known = None
        if s.prompt_prob > 0:
            known = prompt_prefix(k_prompt, mask * (tokens != s.pad_id), s.prompt_prob)
            z = jnp.where(known[..., None], x1, z)
            mask = mask * (~known)

        def logits_of(f, singular=s.use_singular and not s.context_loss):
            return posterior_logits(z, t, embeddings, f, c=s.residual_bound, use_singular=singular, t_eps=s.t_eps)

        zeros = jnp.zeros_like(z)
        use_sc = jax.random.bernoulli(k_sc, s.self_condition_prob, (b, 1, 1))
        # the self-conditioning guess is the sampler's X1_hat: singular logits included
        first = jax.lax.stop_gradient(logits_of(network_residual(model, z, zeros, t, known, segments, embeddings),
                                                s.use_singular))
        sc_guess = posterior_mean(jax.nn.softmax(first, axis=-1), embeddings)
        if known is not None:  # as in prompted sampling: the prompt's X1_hat is the prompt itself
            sc_guess = jnp.where(known[..., None], x1, sc_guess)
        sc_in = jnp.where(use_sc, sc_guess, zeros)
        aux = s.aux_weight > 0
        f, f_aux = (network_residual(model, z, sc_in, t, known, segments, embeddings, aux=True) if aux
                    else (network_residual(model, z, sc_in, t, known, segments, embeddings), None))
        logits = logits_of(f)
        n = jnp.maximum(mask.sum(), 1.0)

        def token_ce(lg):
            lp = jax.nn.log_softmax(lg, axis=-1)
            return -(jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0] * mask).sum() / n, lp

        ce, logp = token_ce(logits)
        accuracy = ((jnp.argmax(logits, -1) == tokens) * mask).sum() / n
        if s.loss == "ce":
            loss = ce
        elif s.loss == "mse":
            v = velocity(z, t, posterior_mean(jnp.exp(logp), embeddings), s.t_eps)
            loss = (((v - (x1 - eps)) ** 2).mean(-1) * mask).sum() / n
        else:
            raise ValueError(f"unknown flow loss {s.loss!r}")
        metrics = {"tokens": mask.sum(), "ce": ce, "accuracy": accuracy}
        if aux:
            aux_ce = token_ce(f_aux)[0]
            loss = loss + s.aux_weight * aux_ce
            metrics["aux_ce"] = aux_ce
        return loss, metrics

    return loss_fn
