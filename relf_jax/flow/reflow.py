"""Regularised reflow: straighten a trained ReLF model on its own (noise, tokens) coupling.

One round:
1. roll the model out from Z_0 ~ N(0, I) with many Euler steps to tokens w_hat (`rollout_pairs`);
2. retrain on pairs with Z_t = t E[w_hat] + (1 - t) Z_0 and cross-entropy towards w_hat,
   plus `data_weight` (lambda) times the ordinary data loss so the model does not drift from
   the data distribution ("regularised", our reading of methods.md) (`make_reflow_loss`). The
   pair term is always the CE under the full posterior (singular logits + residual); with a
   blind-spot model (`FlowLossSettings.context_loss`) only the data term is its context loss:
   on the reflow coupling w_hat_i depends on Z_0 at i itself, so the factorisation behind the
   context loss does not hold there;
3. measure straightness E || (Z_1 - Z_0) - v(Z_t, t) ||^2 on the coupling before and after
   (`measure_straightness`).

A model trained on segment rows (``data.rows="segments"``) is rolled out on rows of one segment
each (``segment_ids``, lengths drawn by the caller from its training segments): pairs, their
loss and straightness cover the segment's positions only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.flow.losses import FlowLossSettings, flow_inputs, make_flow_loss, sample_times
from relf_jax.flow.samplers import euler_integrate, final_tokens, time_grid
from relf_jax.flow.singular import (
    interpolate,
    network_residual,
    posterior_logits,
    posterior_mean,
    straightness,
    velocity,
)


def _residual_fn(graphdef, params, segment_ids=None, table=None):
    return lambda z, t, sc: network_residual(nnx.merge(graphdef, params), z, sc, t, None, segment_ids, table)


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "nfe", "length", "batch", "grid"))
def _rollout(graphdef, params, embeddings, key, segment_ids=None, *, settings: FlowLossSettings, nfe: int,
             length: int, batch: int, grid: str = "uniform"):
    z0 = jax.random.normal(key, (batch, length, embeddings.shape[1]), jnp.float32)
    fn = _residual_fn(graphdef, params, segment_ids, embeddings)
    z1, x1_hat = euler_integrate(z0, fn, embeddings, time_grid(nfe, grid), c=settings.residual_bound,
                                 use_singular=settings.use_singular, t_eps=settings.t_eps)
    tokens = final_tokens(fn, z1, x1_hat, embeddings, c=settings.residual_bound,
                          use_singular=settings.use_singular, t_eps=settings.t_eps)
    return z0, tokens


def rollout_pairs(graphdef, params, embeddings, key, *, n: int, length: int, settings: FlowLossSettings,
                  nfe: int = 64, batch: int = 16, grid: str = "uniform",
                  segment_ids: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(Z_0 [n, L, d] float32, tokens [n, L] int32): the model's own deterministic coupling (Euler,
    `nfe` steps on the time `grid`), on rows of `segment_ids` [n, L] when given (None: whole rows)."""
    z0s, toks = [], []
    if segment_ids is not None:  # whole batches: repeat the last rows' ids
        segment_ids = np.concatenate([segment_ids, segment_ids[:(-n) % batch]])
    for i in range(0, n, batch):
        seg = None if segment_ids is None else jnp.asarray(segment_ids[i:i + batch])
        z0, tok = _rollout(graphdef, params, embeddings, jax.random.fold_in(key, i), seg, settings=settings, nfe=nfe,
                           length=length, batch=batch, grid=grid)
        z0s.append(np.asarray(z0))
        toks.append(np.asarray(tok))
    return np.concatenate(z0s)[:n], np.concatenate(toks)[:n]


def measure_straightness(graphdef, params, embeddings, z0, tokens, *, settings: FlowLossSettings,
                         num_times: int = 8, segment_ids: np.ndarray | None = None) -> float:
    """E || (E[w_hat] - Z_0) - v(Z_t, t) ||^2 on the straight path of each pair (sc = 0), over the
    positions of a non-zero segment id when `segment_ids` [n, L] is given."""
    seg = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    return float(_straightness(graphdef, params, jnp.asarray(embeddings, jnp.float32), jnp.asarray(z0),
                               jnp.asarray(tokens), seg, settings=settings, num_times=num_times))


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "num_times"))
def _straightness(graphdef, params, embeddings, z0, tokens, segment_ids=None, *, settings: FlowLossSettings,
                  num_times: int):
    """Compiled once per network structure, settings and shapes (a reflow round measures before
    and after training with the same program)."""
    fn = _residual_fn(graphdef, params, segment_ids, embeddings)

    def v_fn(z, t):
        logits = posterior_logits(z, t, embeddings, fn(z, t, jnp.zeros_like(z)), c=settings.residual_bound,
                                  use_singular=settings.use_singular, t_eps=settings.t_eps)
        return velocity(z, t, posterior_mean(jax.nn.softmax(logits, -1), embeddings), settings.t_eps)

    ts = (jnp.arange(num_times, dtype=jnp.float32) + 0.5) / num_times
    x1 = jnp.take(embeddings, tokens, axis=0)
    if segment_ids is None:
        return straightness(z0, x1, v_fn, ts)
    mask = (segment_ids != 0).astype(jnp.float32)

    def one_time(t):
        tb = jnp.full((z0.shape[0],), t, jnp.float32)
        err = (x1 - z0) - v_fn(interpolate(x1, z0, tb), tb)
        return (jnp.sum(err * err, axis=-1) * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    return jnp.mean(jax.lax.map(one_time, ts))


# lambda, the data loss's weight in a reflow round (see `make_reflow_loss`)
DATA_WEIGHT = 1.0


def make_reflow_loss(settings: FlowLossSettings, data_weight: float = DATA_WEIGHT, pair_weight: float = 1.0):
    """loss_fn(model, batch, key, frozen): pair_weight * CE on reflow pairs (batch["z0"],
    batch["pair_tokens"]) + data_weight * the data flow loss on batch["tokens"] (regularisation,
    our reading). ``pair_weight=0`` is the no-pairs control: the same batches and schedule, data
    loss only, so a round's gain can be told apart from that of training longer. lambda = 1 by
    default: from a 1,200-step blind-spot `cpu` model, two rounds at lambda = 1 gave 8-NFE gen
    PPL 246.8, below the control's 282.3, while lambda = 0.2 gave 302.3 (README, ReLF, run 6)."""
    if data_weight < 0 or pair_weight < 0 or data_weight + pair_weight <= 0:
        raise ValueError(f"reflow loss weights must be >= 0 and not both 0, got data_weight={data_weight}, "
                         f"pair_weight={pair_weight}")
    data_loss = make_flow_loss(settings)
    s = settings

    def loss_fn(model, batch, key, frozen):
        embeddings = frozen["embeddings"].astype(jnp.float32)
        k_pair, k_sc, k_data = jax.random.split(key, 3)
        if pair_weight == 0:  # the control: no pair forward at all
            d_loss, d_aux = data_loss(model, batch, k_data, frozen)
            return data_weight * d_loss, {"data_ce": d_aux["ce"], "tokens": d_aux["tokens"]}
        tokens = batch["pair_tokens"]
        z0 = batch["z0"].astype(jnp.float32)
        seg = batch.get("pair_segment_ids")
        mask = jnp.ones(tokens.shape, jnp.float32) if seg is None else (seg != 0).astype(jnp.float32)
        t = sample_times(k_pair, tokens.shape[0], s.t_distribution)
        z = interpolate(jnp.take(embeddings, tokens, axis=0), z0, t)

        def logits_of(sc):
            return posterior_logits(z, t, embeddings, network_residual(model, z, sc, t, None, seg, embeddings),
                                    c=s.residual_bound, use_singular=s.use_singular, t_eps=s.t_eps)

        zeros = jnp.zeros_like(z)
        guess = posterior_mean(jax.nn.softmax(jax.lax.stop_gradient(logits_of(zeros)), -1), embeddings)
        use_sc = jax.random.bernoulli(k_sc, s.self_condition_prob, (tokens.shape[0], 1, 1))
        logp = jax.nn.log_softmax(logits_of(jnp.where(use_sc, guess, zeros)), -1)
        pair_ce = -(jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0] * mask).sum() / jnp.maximum(
            mask.sum(), 1.0)
        total, aux = pair_weight * pair_ce, {"pair_ce": pair_ce}
        if data_weight > 0:
            d_loss, d_aux = data_loss(model, batch, k_data, frozen)
            total = total + data_weight * d_loss
            aux.update(data_ce=d_aux["ce"], tokens=d_aux["tokens"])
        return total, aux

    return loss_fn


class PairBatches:
    """Reflow batches: random pairs (seeded, resumable) zipped with a data iterator's batches;
    with `segment_ids` [n, L] each pair's rows carry them (``pair_segment_ids``)."""

    def __init__(self, z0: np.ndarray, tokens: np.ndarray, data, batch_size: int, seed: int = 0,
                 segment_ids: np.ndarray | None = None):
        self.z0, self.tokens, self.data, self.batch_size, self.seed, self.i = z0, tokens, data, batch_size, seed, 0
        self.segment_ids = segment_ids

    def __iter__(self):
        return self

    def __next__(self):
        idx = np.random.default_rng((self.seed, self.i)).integers(0, len(self.tokens), self.batch_size)
        self.i += 1
        out = dict(next(self.data))
        out["z0"], out["pair_tokens"] = self.z0[idx], self.tokens[idx]
        if self.segment_ids is not None:
            out["pair_segment_ids"] = self.segment_ids[idx]
        return out

    def get_state(self):
        return {"i": self.i, "data": self.data.get_state() if hasattr(self.data, "get_state") else None}

    def set_state(self, state):
        self.i = int(state["i"])
        if state.get("data") is not None and hasattr(self.data, "set_state"):
            self.data.set_state(state["data"])


__all__ = ["DATA_WEIGHT", "PairBatches", "make_reflow_loss", "measure_straightness", "rollout_pairs", "flow_inputs"]
