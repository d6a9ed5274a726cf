"""Decoder-only causal language model with a fixed-size KV cache.

The network only: token ids in, float32 logits out. It knows nothing of drafts,
verification or sampling; those live in `relf_jax.sampling` and `relf_jax.speculative`.

Cache convention: slot j of a row's cache holds the keys/values of the token at position j of
that row. A query at position p sees slots 0..p, so slots past a row's length (left over from
padding or a rolled-back speculation) are masked, never trusted, and overwritten on reuse.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.models.layers import (
    KVCache,
    RMSNorm,
    causal_mask,
    decoder_stack,
    dense,
    dense_shape,
    make_param,
)
from relf_jax.runtime.sharding import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class CausalLM(nnx.Module):
    """Token embedding -> N pre-norm transformer blocks -> RMSNorm -> vocabulary logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer) before building a model")
        self.cfg = cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        self.embed = make_param(rngs, jax.nn.initializers.normal(stddev=1.0), (cfg.vocab_size, cfg.d_model),
                                ("vocab", "embed"), pdtype)
        self.blocks = decoder_stack(cfg, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
        if not cfg.tie_embeddings:
            self.lm_head = make_param(rngs, jax.nn.initializers.normal(stddev=cfg.d_model ** -0.5),
                                      *dense_shape((cfg.d_model, cfg.vocab_size), ("embed", "vocab"), "lm_head",
                                                   cfg.weight_layout), pdtype)

    def __call__(self, tokens: jax.Array, positions: Optional[jax.Array] = None, *,
                 segment_ids: Optional[jax.Array] = None, cache: Optional[KVCache] = None,
                 cache_index: Optional[jax.Array] = None, attend_len: Optional[int] = None,
                 logits_at: Optional[jax.Array] = None):
        """Logits for every input position (or, with `logits_at`, one per row).

        tokens, positions, segment_ids: [B, T] int. Without a cache the mask is causal over the
        sequence index, restricted to equal `segment_ids` (packed documents). With a cache
        (from `init_cache`), the T tokens are written at slots ``cache_index[b] + arange(T)``
        and ``positions`` must equal those slots. `attend_len` (a Python int, with a cache): attend
        to the first `attend_len` slots only, which the caller guarantees hold every position the
        queries may see (all positions < attend_len); the cache is still written in full. The
        samplers' prefills pass the prompt length, so a prompt skips the empty rest of its cache.
        (Per decode step this would slice the cache, which XLA:CPU copies every step; the serving
        engines resize the caches instead, `relf_jax.serving.engines.slots.Spans`.) `logits_at` ([B]
        int): only the logits at that position of each row, [B, 1, V] (a prefill needs its
        last prompt position only: the output layer runs once per row instead of T times).
        Returns (logits [B, T, V] float32, cache).

        Dynamic (NTK) rope (`relf_jax.models.layers.Rope`): its frequencies depend on a sequence
        length L, taken as transformers takes it per forward call. Without a cache: each row's
        ``max(positions) + 1`` (the full-sequence forward: logits equal transformers'). With a
        cache and `logits_at` (a prefill): ``logits_at + 1``, the prompt's length, whatever the
        padding (equal to transformers' prefill). With a cache and no `logits_at` (decode steps,
        speculative verification): each position p is rotated with L = p + 1, which is exactly
        what transformers' one-token decode steps do, so a speculative round's target
        distribution equals autoregressive decoding's; keys already in the cache keep the
        rotation they were written with, as in transformers' cache. (transformers takes the
        batch's max and keeps its largest L across calls; relf_jax is per row and stateless.)
        """
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        if self.cfg.embed_scaling:
            x = x * jnp.asarray(self.cfg.d_model ** 0.5, self.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        if cache is None:
            idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            mask = causal_mask(idx, idx, segment_ids, segment_ids)
        else:
            s = cache[0][0].shape[2] if attend_len is None else min(attend_len, cache[0][0].shape[2])
            slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
            mask = causal_mask(positions, slots)
        rope_len = None
        if self.cfg.rope_scaling == "dynamic":
            if cache is None:
                rope_len = jnp.max(positions, axis=1, keepdims=True) + 1
            elif logits_at is not None:
                rope_len = logits_at[:, None] + 1
            else:
                rope_len = positions + 1
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, positions, mask, cache=None if cache is None else cache[i], cache_index=cache_index,
                         rope_len=rope_len)
            new_cache.append(c)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)
        x = self.final_norm(x).astype(jnp.float32)
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("btd,vd->btv", x, self.embed[...].astype(jnp.float32))
            if self.cfg.embed_scaling:
                logits = logits * self.cfg.d_model ** -0.5
        else:
            logits = dense(x, self.lm_head[...].astype(jnp.float32), self.cfg.weight_layout)
        logits = constrain(logits, ("batch", "length", "vocab"))
        return logits, (None if cache is None else tuple(new_cache))

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """Zeroed KV cache: per layer (k, v), each [batch, num_kv_heads, max_len, head_dim]."""
        return init_cache(self.cfg, batch, max_len, dtype)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    dtype = dtype or DTYPES[cfg.dtype]
    shape = (batch, cfg.num_kv_heads, max_len, cfg.resolved_head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers))


def count_params(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state))
