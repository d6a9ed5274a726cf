"""The DWS prompt-only workload predictor's network (family "dws"): network only.

Reads a prompt's token ids (no diffusion-model prefill) and returns raw head outputs; the
surface, its invariants and the training losses live in `relf_jax.dws.predictor`.

Encoder: token + learned position embeddings, ``num_layers`` bidirectional transformer
blocks over the valid prompt tokens, then the mean over valid tokens and the last token's
features, concatenated with the prompt-remainder feature (one-hot of P mod d: it fixes the
first output block's capacity) and log(1 + P), through one SiLU layer. Heads, by
``cfg.predictor_head``:
- "surface": ``step_logits`` [B, B_max, d] (step head: a distribution over T_b in 1..d) and a
  block head by ``cfg.predictor_block_head``: ``continue_logits`` [B, B_max - 1] (P(block b+1
  exists | block b exists)) or ``length_logits`` [B, B_max * d] (a distribution over the
  reply's length 1..B_max * d in tokens, from which the blocks follow);
- "length" / "steps": one scalar ``value`` [B] (the scalar baselines on the same encoder).

Sizes for the defaults (d_model 64, 2 layers, vocabulary 1k): about 0.2M parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.models.causal_lm import DTYPES
from relf_jax.models.layers import (
    RMSNorm,
    TransformerBlock,
    bidirectional_mask,
    make_param,
)


class WorkloadPredictor(nnx.Module):

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer) before building a model")
        self.cfg = cfg
        pdtype = DTYPES[cfg.param_dtype]
        d, bs, nb = cfg.d_model, cfg.block_size, cfg.max_blocks
        self.embed = make_param(rngs, jax.nn.initializers.normal(stddev=1.0), (cfg.vocab_size, d),
                                ("vocab", "embed"), pdtype)
        self.pos = make_param(rngs, jax.nn.initializers.normal(stddev=0.1), (cfg.max_seq_len, d), (None, "embed"),
                              pdtype)
        self.blocks = nnx.List([
            TransformerBlock(d, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.mlp_dim,
                             rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
            for _ in range(cfg.num_layers)
        ])
        self.final_norm = RMSNorm(d, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
        n_in = 2 * d + bs + 1
        self.hidden = make_param(rngs, jax.nn.initializers.normal(stddev=n_in ** -0.5), (n_in, d), (None, "embed"),
                                 pdtype)
        self.hidden_bias = make_param(rngs, jax.nn.initializers.zeros, (d,), ("embed",), pdtype)
        block_out = nb * bs if cfg.predictor_block_head == "length" else nb - 1
        out = {"surface": block_out + nb * bs, "length": 1, "steps": 1}[cfg.predictor_head]
        self.head = make_param(rngs, jax.nn.initializers.normal(stddev=0.01), (d, out), ("embed", None), pdtype)
        self.head_bias = make_param(rngs, jax.nn.initializers.zeros, (out,), (None,), pdtype)

    def __call__(self, tokens: jax.Array, length: jax.Array) -> dict:
        """tokens [B, L] int (the prompt's ids, padded or cut to L <= max_seq_len); length [B]
        the prompt's full token count P (used for the remainder and length features)."""
        cfg = self.cfg
        b, seq = tokens.shape
        valid = jnp.arange(seq)[None, :] < jnp.minimum(length, seq)[:, None]
        x = jnp.take(self.embed[...], tokens, axis=0).astype(jnp.float32) + self.pos[:seq][None].astype(jnp.float32)
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (b, seq))
        mask = bidirectional_mask(valid, seq)
        for block in self.blocks:
            x, _ = block(x, positions, mask)
        x = self.final_norm(x).astype(jnp.float32)
        w = valid.astype(jnp.float32)[..., None]
        mean = (x * w).sum(1) / jnp.maximum(w.sum(1), 1.0)
        last = jnp.take_along_axis(x, (jnp.minimum(length, seq) - 1).clip(0)[:, None, None], axis=1)[:, 0]
        rem = jax.nn.one_hot(length % cfg.block_size, cfg.block_size, dtype=jnp.float32)
        feats = jnp.concatenate([mean, last, rem, jnp.log1p(length.astype(jnp.float32))[:, None]], axis=-1)
        h = jax.nn.silu(feats @ self.hidden[...].astype(jnp.float32) + self.hidden_bias[...].astype(jnp.float32))
        out = h @ self.head[...].astype(jnp.float32) + self.head_bias[...].astype(jnp.float32)
        if cfg.predictor_head != "surface":
            return {"value": out[:, 0]}
        nb, bs = cfg.max_blocks, cfg.block_size
        steps = out[:, -nb * bs:].reshape(b, nb, bs)
        if cfg.predictor_block_head == "length":
            return {"length_logits": out[:, :nb * bs], "step_logits": steps}
        return {"continue_logits": out[:, :nb - 1], "step_logits": steps}
