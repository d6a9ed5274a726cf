"""Block-diffusion language model (BD3-LM style): network only.

A sequence is cut into blocks of ``block_size`` tokens aligned on absolute positions (block j
holds positions ``j*d .. j*d + d - 1``). Attention is bidirectional inside a block and causal
across blocks; inside the block being generated some tokens are the mask token. The network
maps tokens (with masks) to float32 logits over the vocabulary; the masked-diffusion loss lives
in `relf_jax.train.objectives` and the confidence-threshold decoder in `relf_jax.sampling.block_diffusion`.

The embedding table has one row more than the vocabulary: id ``vocab_size`` is the mask token
(`mask_id`), which the output never predicts.

Two ways to call it:
- ``__call__(tokens, positions, mask, cache=None, cache_index=None)``: any attention mask
  (``block_causal_mask`` for clean text, `decode_mask` for a block attending to a cache);
  the decoder writes each block's keys/values into a fixed-size KV cache, one slot per
  position, like `CausalLM`.
- `training_logits(noisy, clean, segment_ids)`: the BD3-LM training pass over
  ``[noisy; clean]`` (length 2L) in one forward: a noisy token of block j sees the noisy tokens
  of its own block and the clean tokens of blocks < j; clean tokens see clean tokens
  block-causally. So every block is denoised given the clean text before it, as at decoding
  time. With `segment_ids` (packed rows: several documents per row, id 0 = padding) nothing
  attends across documents, positions restart at 0 in each document and blocks are counted
  from each document's start, so every document sees exactly the layout it has at decoding
  time (training rows fill each document up to whole blocks: `relf_jax.data.pipeline`'s
  ``align``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from relf_jax.config import ModelConfig
from relf_jax.data.pipeline import segment_positions
from relf_jax.models.causal_lm import DTYPES
from relf_jax.models.layers import (
    KVCache,
    RMSNorm,
    block_causal_mask,
    decoder_stack,
    make_param,
)
from relf_jax.runtime.sharding import constrain


def mask_id(cfg: ModelConfig) -> int:
    """The mask token's id: one past the vocabulary."""
    return cfg.vocab_size


def training_mask(length: int, block_size: int) -> jax.Array:
    """[2L, 2L] bool mask of the ``[noisy; clean]`` training pass of one document (module docstring)."""
    seg = jnp.ones((1, length), jnp.int32)
    return packed_training_mask(seg, jnp.arange(length, dtype=jnp.int32)[None], block_size)[0]


def packed_training_mask(segment_ids: jax.Array, positions: jax.Array, block_size: int) -> jax.Array:
    """[B, 2L, 2L] bool mask of the ``[noisy; clean]`` pass over packed rows.

    segment_ids, positions: [B, L] (positions restart at 0 in each document). Query and key
    must share a non-zero segment id; blocks are ``position // block_size`` within the document.
    A noisy query sees the noisy keys of its own block and the clean keys of earlier blocks; a
    clean query sees the clean keys of its block and earlier ones.
    """
    blk = positions // block_size
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    same = same_doc & (blk[:, None, :] == blk[:, :, None])
    before = same_doc & (blk[:, None, :] < blk[:, :, None])
    upto = same_doc & (blk[:, None, :] <= blk[:, :, None])
    # a padding query (id 0) would see nothing; let it see itself so its softmax stays finite
    eye = jnp.eye(segment_ids.shape[1], dtype=bool)[None] & (segment_ids[:, :, None] == 0)
    top = jnp.concatenate([same | eye, before], axis=2)  # noisy queries: own noisy block | earlier clean blocks
    bottom = jnp.concatenate([jnp.zeros_like(same), upto | eye], axis=2)  # clean queries: clean blocks up to theirs
    return jnp.concatenate([top, bottom], axis=1)


def decode_mask(positions: jax.Array, num_slots: int, block_size: int) -> jax.Array:
    """[B, T, S] bool: queries at `positions` [B, T] see cache slots of their block and earlier."""
    b = positions.shape[0]
    slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (b, num_slots))
    return block_causal_mask(positions, slots, block_size)


class BlockDiffusionLM(nnx.Module):
    """Token (or mask) embedding -> N pre-norm blocks -> RMSNorm -> vocabulary logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (from the tokenizer) before building a model")
        if cfg.block_size < 1:
            raise ValueError(f"model.block_size must be >= 1, got {cfg.block_size}")
        self.cfg = cfg
        dtype, pdtype = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        self.dtype = dtype
        self.embed = make_param(rngs, jax.nn.initializers.normal(stddev=1.0), (cfg.vocab_size + 1, cfg.d_model),
                                ("vocab", "embed"), pdtype)
        self.blocks = decoder_stack(cfg, rngs=rngs, dtype=dtype, param_dtype=pdtype)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs, param_dtype=pdtype)
        self.lm_head = make_param(rngs, jax.nn.initializers.normal(stddev=cfg.d_model ** -0.5),
                                  (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), pdtype)

    def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array, *,
                 cache: KVCache | None = None, cache_index: jax.Array | None = None):
        """tokens, positions: [B, T] int; mask: [B, T, S] bool (S = T without a cache).

        With a cache ([B, K, S, Dh] per layer), the T new keys/values are written at slots
        ``cache_index[b] + arange(T)`` first. Returns (logits [B, T, V] float32, cache).
        """
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.dtype)
        x = x * jnp.asarray(self.cfg.d_model ** 0.5, self.dtype)
        x = constrain(x, ("batch", "length", "embed"))
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, c = block(x, positions, mask, cache=None if cache is None else cache[i], cache_index=cache_index)
            new_cache.append(c)
        x = self.final_norm(x).astype(jnp.float32)
        logits = constrain(x @ self.lm_head[...].astype(jnp.float32), ("batch", "length", "vocab"))
        return logits, (None if cache is None else tuple(new_cache))

    def training_logits(self, noisy: jax.Array, clean: jax.Array, segment_ids: jax.Array | None = None,
                        positions: jax.Array | None = None) -> jax.Array:
        """Logits [B, L, V] for the noisy tokens [B, L] given the clean sequence [B, L].

        `segment_ids` [B, L] (default: one document per row) keeps packed documents apart;
        `positions` [B, L] default to each token's offset in its document.
        """
        b, length = noisy.shape
        if segment_ids is None:
            segment_ids = jnp.ones((b, length), jnp.int32)
        if positions is None:
            positions = segment_positions(segment_ids)
        mask = packed_training_mask(segment_ids, positions, self.cfg.block_size)
        logits, _ = self(jnp.concatenate([noisy, clean], axis=1), jnp.concatenate([positions, positions], axis=1),
                         mask)
        return logits[:, :length]
