"""The ReLF network: a bidirectional transformer over noisy token embeddings.

Network only: it maps (Z_t, self-conditioning input, t) to *residual* logits f over the
vocabulary. The singular logits, the bound c * tanh(f / c), the posterior, X1_hat and the
velocity live in `relf_jax.flow`.

Inputs: z, sc [B, L, d_emb] (d_emb = the fixed embedding width, e.g. 32), t [B] in [0, 1], or
[B, L] for a time per position (trained with `flow.per_position_t`; the conditioning is then per
position too).
z and sc are projected to the model width and added, together with a learned absolute
position embedding (rows are whole documents that start at position 0, and at small t the
noisy input carries no position information that rotary attention could use); t enters every
block through adaLN conditioning (a sinusoidal embedding followed by an MLP). Attention is
bidirectional (in the blind-spot network below, the default, two causal streams, one per
direction). With ``segment_ids`` [B, L] (packed rows, `relf_jax.data.pipeline`, ``data.rows=
"segments"``) attention stays within a segment and positions restart at 0 in each.

With ``cfg.flow_prompt_input`` the network also takes ``known`` [B, L] bool: a learned vector is
added at the positions that hold a clean prompt (z there is the token's embedding itself), so it
can tell a given token from a noisy one at the same time t (trained by `flow.prompt_prob`).

With ``cfg.flow_aux_head`` a second output head (zero-initialised) reads the same final hidden
state; `logits_and_aux` returns both. The flow loss trains it as a plain, singular-free token
classifier (`flow.aux_weight`); samplers use `__call__` and never see it.

With ``cfg.flow_blind_spot`` (the default since issue 35; `flow.blind_spot`) the residual at position i
never depends on position i's own inputs (z_i, sc_i): ``num_layers / 2`` causal blocks run left
to right and as many right to left over the same projected inputs; position i reads the left
stream at i - 1 (inputs 0..i-1) and the right stream at i + 1 (inputs i+1..L-1), concatenated,
projected, time-conditioned and passed through one MLP block. Trained as the classifier
p(x_i | Z_{-i}) (`flow.losses`, ``context_loss``), its output added to the singular logits
log p(Z_i | x_i) gives the exact posterior, since Z_i and Z_{-i} are independent given x_i.
Self-conditioning still leaks a little of z_i through the neighbours' sc (each neighbour's
X1_hat was computed from all of Z). With ``cfg.flow_query_layers`` = q > 0 the streams get
(num_layers - q) / 2 layers each and q query layers follow the MLP block: position i's query
attends to the left stream's states at every j < i and the right stream's at every j > i in one
softmax (and to itself, never to another query), so both sides' tokens mix in attention rather
than only through i - 1 and i + 1; still blind to position i.

With ``cfg.flow_embed_head`` (our extension, the default since 12-07) the residual head is
f = h W + (h P) E^T: besides the free [d, V] matrix W, a zero-initialised P [d, d_emb] maps the
hidden state into the fixed embeddings' space, and every word's logit reads it through its own
embedding E_w (``embeddings=``, passed by `relf_jax.flow.singular.network_residual`). Words share
that part of the head the way tied input/output embeddings share it in a small LM; on the chat
corpus it cut ReLF-64's gen PPL by about a quarter at 600 steps (docs/relf.md). It reads no
position's input, so a blind-spot network stays blind.

With ``cfg.flow_evidence_input`` (our extension, off) each position's own evidence, the clipped
log of its singular posterior, is a further input (``evidence=``, computed by
`relf_jax.flow.singular.evidence_input`; `relf_jax.flow.singular.network_residual` calls the
network with it): a function of z_j alone, so the blind spot stays exact. Measured on the toy: no gain (docs/relf.md).

With ``cfg.flow_bag_input`` (our extension, the default since 2026-12-07) the blind-spot network's
combine block also reads a leave-one-out bag of its segment: a per-token MLP of each input
(time-conditioned), summed over the other positions of i's segment and divided by the square root
of their number, projected by a zero-initialised matrix. It is the form of a Bayes reader of the
conversation's topic from noisy neighbours (a sum of per-token log-likelihoods); position i's input
never enters its own bag.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.data.pipeline import segment_positions
from relf_jax.models.causal_lm import DTYPES
from relf_jax.models.layers import (
    RMSNorm,
    SwiGLU,
    TransformerBlock,
    causal_mask,
    make_param,
)
from relf_jax.runtime.sharding import constrain

TIME_FEATURES = 64


def time_features(t: jax.Array, dim: int = TIME_FEATURES) -> jax.Array:
    """Sinusoidal features of t in [0, 1]: [...] -> [..., dim] ([B] per row, [B, L] per position)."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / half)
    angles = (1000.0 * t.astype(jnp.float32))[..., None] * freqs
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class FlowLM(nnx.Module):
    """Residual-logit network of a rectified language flow (ReLF)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer) before building a model")
        if cfg.flow_embed_dim <= 0:
            raise ValueError("ModelConfig.flow_embed_dim must be > 0 for the relf family")
        self.cfg = cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        d_emb, d = cfg.flow_embed_dim, cfg.d_model
        init = jax.nn.initializers.normal(stddev=d_emb ** -0.5)
        self.in_z = make_param(rngs, init, (d_emb, d), (None, "embed"), pdtype)
        self.in_sc = make_param(rngs, init, (d_emb, d), (None, "embed"), pdtype)
        self.in_ev = (make_param(rngs, jax.nn.initializers.normal(stddev=cfg.vocab_size ** -0.5),
                                 (cfg.vocab_size, d), ("vocab", "embed"), pdtype)
                      if cfg.flow_evidence_input else None)
        self.pos = make_param(rngs, jax.nn.initializers.normal(stddev=1.0), (cfg.max_seq_len, d), (None, "embed"),
                              pdtype)
        # zeros: a model that never sees a prompt in training computes exactly what it would without it
        self.in_known = (make_param(rngs, jax.nn.initializers.zeros, (d,), ("embed",), pdtype)
                         if cfg.flow_prompt_input else None)
        self.time_in = make_param(rngs, jax.nn.initializers.normal(stddev=TIME_FEATURES ** -0.5),
                                  (TIME_FEATURES, d), (None, "embed"), pdtype)
        self.time_out = make_param(rngs, jax.nn.initializers.normal(stddev=d ** -0.5), (d, d),
                                   ("embed", None), pdtype)
        self.blind_spot = bool(cfg.flow_blind_spot)
        query_layers = cfg.flow_query_layers if self.blind_spot else 0
        stream_layers = cfg.num_layers - query_layers
        if self.blind_spot and (query_layers < 0 or stream_layers < 2 or stream_layers % 2):
            raise ValueError(f"a blind-spot ReLF network splits model.num_layers - model.flow_query_layers between "
                             f"two streams: it needs an even number >= 2, got {cfg.num_layers} - {query_layers}")

        def stack(n):
            return nnx.List([
                TransformerBlock(d, cfg.num_heads, cfg.resolved_flow_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                                 rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, cond_dim=d, rngs=rngs,
                                 dtype=dtype, param_dtype=pdtype)
                for _ in range(n)
            ])
        # blind spot: `blocks` is the left-to-right stream, `blocks_bwd` the right-to-left one
        self.blocks = stack(stream_layers // 2 if self.blind_spot else cfg.num_layers)
        if self.blind_spot:
            self.blocks_bwd = stack(stream_layers // 2)
            self.query_blocks = stack(query_layers)
            self.combine_in = make_param(rngs, jax.nn.initializers.normal(stddev=(2 * d) ** -0.5), (2 * d, d),
                                         (None, "embed"), pdtype)
            self.combine_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
            self.combine_mlp = SwiGLU(d, cfg.mlp_dim, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        # the bag input: (norm, per-token MLP, zero-initialised projection)
        self.bag = (nnx.List([RMSNorm(d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype),
                              SwiGLU(d, cfg.mlp_dim, rngs=rngs, dtype=dtype, param_dtype=pdtype),
                              make_param(rngs, jax.nn.initializers.zeros, (d, d), (None, "embed"), pdtype)])
                    if self.blind_spot and cfg.flow_bag_input else None)
        self.final_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
        self.out = make_param(rngs, jax.nn.initializers.zeros, (d, cfg.vocab_size), ("embed", "vocab"), pdtype)
        self.out_emb = (make_param(rngs, jax.nn.initializers.zeros, (d, d_emb), ("embed", None), pdtype)
                        if cfg.flow_embed_head else None)
        self.out_aux = (make_param(rngs, jax.nn.initializers.zeros, (d, cfg.vocab_size), ("embed", "vocab"), pdtype)
                        if cfg.flow_aux_head else None)

    def __call__(self, z: jax.Array, sc: jax.Array, t: jax.Array, known: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, evidence: jax.Array | None = None,
                 embeddings: jax.Array | None = None) -> jax.Array:
        """Residual logits [B, L, V] (float32) for noisy embeddings z, self-conditioning sc, time t;
        known [B, L] bool flags clean prompt positions (only for a model built with
        ``flow_prompt_input``); segment_ids [B, L] int32 (packed rows, `relf_jax.data.pipeline`):
        positions attend only within their segment and count from 0 in each (None: one segment);
        evidence [B, L, V]: each position's clipped singular log-posterior, for a model built with
        ``flow_evidence_input`` (`reads_evidence`; `relf_jax.flow.singular.evidence_input`);
        embeddings [V, d_emb]: the fixed token embeddings, for a model built with
        ``flow_embed_head`` (the default; ignored without it)."""
        return self._residual(self._hidden(z, sc, t, known, segment_ids, evidence), embeddings)

    @property
    def reads_evidence(self) -> bool:
        """Whether the network takes the ``evidence`` input (built with ``flow_evidence_input``)."""
        return self.in_ev is not None

    def _residual(self, h: jax.Array, embeddings: jax.Array | None) -> jax.Array:
        f = self._head(h, self.out)
        if self.out_emb is None:
            return f
        if embeddings is None:
            raise ValueError("this ReLF model's head reads the fixed embeddings (model.flow_embed_head): "
                             "pass embeddings= (relf_jax.flow.singular.network_residual does)")
        g = h @ self.out_emb[...].astype(jnp.float32)
        return f + constrain(g @ embeddings.astype(jnp.float32).T, ("batch", "length", "vocab"))

    def logits_and_aux(self, z: jax.Array, sc: jax.Array, t: jax.Array, known: jax.Array | None = None,
                       segment_ids: jax.Array | None = None, evidence: jax.Array | None = None,
                       embeddings: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(residual logits, auxiliary head's logits), both [B, L, V] float32, from one pass
        (only for a model built with ``flow_aux_head``)."""
        if self.out_aux is None:
            raise ValueError("this ReLF model was not built with an auxiliary head (model.flow_aux_head)")
        h = self._hidden(z, sc, t, known, segment_ids, evidence)
        return self._residual(h, embeddings), self._head(h, self.out_aux)

    @staticmethod
    def _head(h: jax.Array, w: nnx.Param) -> jax.Array:
        return constrain(h @ w[...].astype(jnp.float32), ("batch", "length", "vocab"))

    def _hidden(self, z, sc, t, known, segment_ids=None, evidence=None):
        """Final normed hidden state [B, L, d_model] (float32)."""
        b, length, _ = z.shape
        dt = self.dtype
        if length > self.pos.shape[0]:
            raise ValueError(f"sequence length {length} exceeds model.max_seq_len={self.pos.shape[0]}")
        if segment_ids is None:
            segment_ids = jnp.ones((b, length), jnp.int32)
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
        positions = segment_positions(segment_ids)
        x = (z.astype(dt) @ self.in_z[...].astype(dt)) + (sc.astype(dt) @ self.in_sc[...].astype(dt))
        x = x + jnp.take(self.pos[...], positions, axis=0).astype(dt)
        if self.in_ev is not None:
            if evidence is None:
                raise ValueError("this ReLF model reads each position's evidence (model.flow_evidence_input): "
                                 "pass evidence= (relf_jax.flow.singular.evidence_input)")
            x = x + (evidence.astype(dt) @ self.in_ev[...].astype(dt))
        if known is not None:
            if self.in_known is None:
                raise ValueError("this ReLF model was not built with a prompt input (model.flow_prompt_input)")
            x = x + known[..., None].astype(dt) * self.in_known[...].astype(dt)
        x = constrain(x, ("batch", "length", "embed"))
        cond = jax.nn.silu(time_features(t) @ self.time_in[...].astype(jnp.float32))
        cond = cond @ self.time_out[...].astype(jnp.float32)
        if self.blind_spot:
            return self._blind_spot_hidden(x, positions, cond, segment_ids)
        mask = segment_ids[:, :, None] == segment_ids[:, None, :]
        for block in self.blocks:
            x, _ = block(x, positions, mask, cond=cond)
        return self.final_norm(x).astype(jnp.float32)

    def _blind_spot_hidden(self, x, positions, cond, segment_ids):
        """Hidden state at i from the left stream at i - 1 (inputs 0..i-1) and the right stream at
        i + 1 (inputs i+1..L-1), both within i's segment: position i's own input never reaches it."""
        idx = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), segment_ids.shape)
        fwd_mask = causal_mask(idx, idx, segment_ids, segment_ids)
        bwd_mask = jnp.swapaxes(fwd_mask, 1, 2)
        fwd, bwd = x, x
        for block in self.blocks:
            fwd, _ = block(fwd, positions, fwd_mask, cond=cond)
        for block in self.blocks_bwd:
            bwd, _ = block(bwd, positions, bwd_mask, cond=cond)
        same_left = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (1, 0)))[..., None]
        same_right = jnp.pad(segment_ids[:, :-1] == segment_ids[:, 1:], ((0, 0), (0, 1)))[..., None]
        left = jnp.where(same_left, jnp.pad(fwd[:, :-1], ((0, 0), (1, 0), (0, 0))), 0)
        right = jnp.where(same_right, jnp.pad(bwd[:, 1:], ((0, 0), (0, 1), (0, 0))), 0)
        h = jnp.concatenate([left, right], axis=-1) @ self.combine_in[...].astype(left.dtype)
        cond_l = (cond[:, None, :] if cond.ndim == 2 else cond).astype(h.dtype)
        h = h + cond_l
        if self.bag is not None:
            h = h + self._bag(x, cond_l, segment_ids, idx)
        h = h + self.combine_mlp(self.combine_norm(h)).astype(h.dtype)
        if len(self.query_blocks):
            h = self._query_layers(h, fwd, bwd, positions, cond, segment_ids, idx)
        return self.final_norm(h).astype(jnp.float32)

    def _bag(self, x, cond, segment_ids, idx):
        """The leave-one-out bag [B, L, d]: sum over j != i in i's segment of MLP(x_j, t), / sqrt of
        their number, projected (``model.flow_bag_input``)."""
        norm, mlp, proj = self.bag
        g = mlp(norm(x + cond))
        others = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (idx[:, :, None] != idx[:, None, :])
        others = others.astype(g.dtype)
        bag = jnp.einsum("bij,bjd->bid", others, g) * jax.lax.rsqrt(jnp.maximum(others.sum(-1), 1.0))[..., None]
        return bag @ proj[...].astype(g.dtype)

    def _query_layers(self, h, fwd, bwd, positions, cond, segment_ids, idx):
        """Query layers over the streams' final states: query i attends to left-stream states
        j < i, right-stream states j > i (both in i's segment; each holds inputs on i's side only)
        and to itself; never to another query, whose inputs include position i's."""
        length = h.shape[1]
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        left = same & (idx[:, None, :] < idx[:, :, None])
        right = same & (idx[:, None, :] > idx[:, :, None])
        self_only = jnp.broadcast_to(jnp.eye(length, dtype=bool), left.shape)
        mask = jnp.concatenate([left, right, self_only], axis=-1)  # [B, L, 2L + L]
        ctx = jnp.concatenate([fwd, bwd], axis=1)
        ctx_cond = cond if cond.ndim == 2 else jnp.concatenate([cond, cond], axis=1)
        context = (ctx, jnp.concatenate([positions, positions], axis=1), ctx_cond)
        for block in self.query_blocks:
            h, _ = block(h, positions, mask, cond=cond, context=context)
        return h
